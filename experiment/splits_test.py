"""The validation split: carved from train only, deterministic, and kept out of the corpus."""

import sys

import pytest

from envs.tasks import suite_pyfunc
from experiment import splits


def test_validation_comes_from_train_and_is_deterministic():
  tasks = suite_pyfunc.generate()
  relabelled, train, val = splits.carve_validation(tasks, 1 / 6)
  heldout_ids = {t.task_id for t in tasks if t.split == "test"}
  train_ids = {t.task_id for t in tasks if t.split == "train"}
  val_ids = {t.task_id for t in val}
  assert val_ids and val_ids <= train_ids and not val_ids & heldout_ids
  assert {t.task_id for t in train} == train_ids - val_ids
  assert 0.1 < len(val) / len(train_ids) < 0.25
  assert all(t.split == splits.VALIDATION for t in val)
  assert [t.task_id for t in relabelled] == [t.task_id for t in tasks]
  assert {t.task_id for t in relabelled if t.split == "test"} == heldout_ids
  # Same tasks whatever the order they come in.
  _, _, again = splits.carve_validation(list(reversed(tasks)), 1 / 6)
  assert {t.task_id for t in again} == val_ids


def test_corpus_leaves_out_validation_tasks():
  relabelled, train, val = splits.carve_validation(suite_pyfunc.generate(), 1 / 6)
  docs = suite_pyfunc.pretraining_corpus(relabelled, n_snippets=50, seed=0)
  text = "\n".join(docs)
  assert not any(t.prompt in text for t in val)
  assert all(t.prompt + t.solution in docs for t in train)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_bad_fraction_is_an_error(fraction):
  with pytest.raises(ValueError, match="fraction"):
    splits.carve_validation(suite_pyfunc.generate(), fraction)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
