"""eval_fresh: its tasks are none of the suite's nor of RL's fresh ones, and it scores a saved
model on them as the experiment scores its split, writing per-task results."""

import json
import sys

import pytest

from envs.tasks import suite_repo
from moe import build
from moe import checkpoint as moe_checkpoint
from moe.config import ModelConfig
from tools import eval_fresh


def _fixes(tasks):
  return {tuple(sorted(t.metadata["fix"].items())) for t in tasks}


def test_fresh_tasks_avoid_the_suite_and_rl_fresh_tasks():
  tasks = eval_fresh.fresh_tasks(40, ("helper", "imports", "op", "rename"))
  per = {}
  for t in tasks:
    per[t.metadata["template"]] = per.get(t.metadata["template"], 0) + 1
  assert per == dict(eval_fresh.PER_TEMPLATE)
  suite = suite_repo.generate()
  rl = suite_repo.generate_fresh(suite, seed=3, per_template=40,
                                 templates=("helper", "imports", "op", "rename"))
  assert not _fixes(tasks) & _fixes(suite) and not _fixes(tasks) & _fixes(rl)
  assert len(_fixes(tasks)) == len(tasks)
  assert [t.files for t in eval_fresh.fresh_tasks(40, ("helper", "imports", "op", "rename"))] \
      == [t.files for t in tasks]


def test_scores_a_saved_model_and_refuses_bad_input(tmp_path, capsys):
  # A random byte-level model: the opening prompt is ~700 bytes, so the window is larger than
  # agent.gin's (352 BPE tokens).
  cfg = ModelConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, max_seq_len=1024)
  model_dir = str(tmp_path / "model")
  moe_checkpoint.save_params(build.create(cfg, seed=0), model_dir)
  gin = ["--gin_file=tools/configs/experiments/agent.gin",
         "--gin.ExperimentConfig.tokenizer='bytes'", "--gin.ModelConfig.vocab_size=259",
         "--gin.ModelConfig.hidden_size=32", "--gin.ModelConfig.num_layers=2",
         "--gin.ModelConfig.num_heads=2", "--gin.ModelConfig.num_kv_heads=1",
         "--gin.ModelConfig.intermediate_size=64", "--gin.ModelConfig.moe_intermediate_size=32",
         "--gin.ModelConfig.num_experts=4",
         "--gin.ModelConfig.max_seq_len=1024", "--gin.AgentConfig.max_context_tokens=960",
         "--gin.PipelineConfig.seq_len=1000", "--gin.AgentConfig.max_turns=1",
         "--gin.EvalConfig.samples=1", "--gin.EvalConfig.max_tokens=8"]
  out = tmp_path / "out"
  assert eval_fresh.main([model_dir, "--out", str(out), "--per_template=helper=2,const=1",
                          *gin]) == 0
  rows = [json.loads(l) for l in open(out / "0.jsonl")]
  assert len(rows) == 3 and all(r["n"] == 1 for r in rows)
  assert {r["task_id"].rsplit("-", 1)[0] for r in rows} == {"repo-fresh-helper",
                                                             "repo-fresh-const"}
  summary = json.load(open(out / "summary.json"))
  assert summary[model_dir]["samples"] == 3
  assert "0: " + model_dir in capsys.readouterr().out
  with pytest.raises(SystemExit):
    eval_fresh.main([str(tmp_path / "nope"), "--out", str(out), *gin])
  with pytest.raises(SystemExit):
    eval_fresh.main([model_dir, "--out", str(out), "--per_template=helper", *gin])


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
