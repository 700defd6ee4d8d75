"""Tests for the tool-call format: the system prompt with all tools or a compact subset."""

import json
import sys

import pytest

from envs.harness import toolcall


def test_default_prompt_lists_every_tool_spec():
  prompt = toolcall.system_prompt()
  assert prompt == toolcall.system_prompt(None)
  for spec in toolcall.TOOL_SPECS:
    assert json.dumps(spec, separators=(",", ":")) in prompt
  assert toolcall.initial_prompt("Fix it.") == (
      toolcall.render_message("system", prompt) + toolcall.render_message("user", "Fix it.") +
      "<|im_start|>assistant\n")


def test_subset_prompt_is_compact_and_lists_only_the_subset():
  names = ("run_tests", "read_file", "edit_file", "list_files", "submit")
  prompt = toolcall.system_prompt(names)
  assert prompt == ("<tools>\nrun_tests(tests?)\nread_file(path)\nedit_file(path,old,new)\n"
                    "list_files(path?)\nsubmit()\n</tools>")
  assert len(prompt) < len(toolcall.system_prompt()) // 5
  assert "write_file" not in prompt and "run(" not in prompt
  # The order given is the order shown.
  assert toolcall.system_prompt(["submit", "read_file"]) == (
      "<tools>\nsubmit()\nread_file(path)\n</tools>")
  assert toolcall.initial_prompt("Go.", names) == (
      toolcall.render_message("system", prompt) + toolcall.render_message("user", "Go.") +
      "<|im_start|>assistant\n")


@pytest.mark.parametrize("bad", [("read_file", "frobnicate"), (), ("submit", "submit")])
def test_subset_prompt_refuses_unknown_empty_or_repeated_names(bad):
  with pytest.raises(ValueError, match="tool_names must be distinct names among"):
    toolcall.system_prompt(bad)


def test_assistant_spans_mark_the_model_turns():
  text = (toolcall.initial_prompt("Fix it.") + '<tool_call>\n{"name":"submit"}\n</tool_call>'
          "<|im_end|>\n" + toolcall.render_responses(["ok"], generation_prompt=False) +
          "<|im_start|>user\nSummarise.<|im_end|>\n<|im_start|>assistant\nDone: x.<|im_end|>")
  spans = toolcall.assistant_spans(text)
  assert "".join(p for p, _ in spans) == text
  assert [p for p, m in spans if m] == [
      '<tool_call>\n{"name":"submit"}\n</tool_call><|im_end|>', "Done: x.<|im_end|>"]
  # A header left open is no turn; an unfinished last turn is the model's.
  assert not any(m for _, m in toolcall.assistant_spans(
      "<|im_start|>assistant\n<|im_start|>user\nhi<|im_end|>\n"))
  assert toolcall.assistant_spans("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nhal"
                                  )[-1] == ("hal", True)
  assert toolcall.assistant_spans("def f():\n  pass\n") is None


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
