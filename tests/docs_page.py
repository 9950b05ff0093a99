"""The interpreter a docs page runs in: a fresh `python` in the repository's root, one per page.

The root conftest.py starts it (`python -c` with this file's text, so that the page sees the
`sys.path` a reader's `python` started in the root has) and sends it the page's blocks in page
order, one JSON request a line on stdin; each gets one JSON answer a line on the stdout the
interpreter started with:

* `{"source", "path", "line", "hidden"}` runs a block (`line`: the page line before its first
  one, so tracebacks name page lines). A visible block runs in the page's namespace, as it
  would in the reader's interpreter. A hidden block (`invisible-code-block`) runs in a copy of
  that namespace with `printed` (what the block before it printed) added: it sees what the
  visible blocks above it made and may check it, but nothing it defines or imports reaches a
  later block, so a page cannot pass on setup its reader does not see. Answer: `{"error":
  null}`, or the traceback (and what the block printed) as text.
* `{"skip"}` evaluates a skip directive's argument (`"reason"` or `if(condition,
  reason="...")`, Sybil's syntax) in the page's namespace. Answer: `{"skip": reason or null}`.

What the page writes to the file descriptors 1 and 2 goes to this process's stderr.
"""

import contextlib
import io
import json
import os
import traceback
from typing import Any


def _when(condition_text: str) -> Any:
  """Sybil's `if(condition, reason=None)`: the reason (the condition's text by default) when
  the condition holds, else None."""
  def skip_if(condition: Any, reason: str | None = None) -> str | None:
    return (reason or condition_text) if condition else None
  return skip_if


def _skip_reason(argument: str, namespace: dict[str, Any]) -> str | None:
  scope = dict(namespace)
  argument = argument.strip()
  if argument.startswith("if"):
    scope["skip_if_"] = _when(argument[2:])
    argument = "skip_if_" + argument[2:]
  return eval(argument, scope) or None


def _run(request: dict[str, Any], namespace: dict[str, Any], printed: str
         ) -> tuple[str | None, str]:
  """Runs one block; returns (the error's text or None, what the block printed)."""
  scope = dict(namespace, printed=printed) if request["hidden"] else namespace
  out = io.StringIO()
  try:
    code = compile("\n" * request["line"] + request["source"], request["path"], "exec",
                   dont_inherit=True)
    with contextlib.redirect_stdout(out):
      exec(code, scope)
  except BaseException as e:  # noqa: BLE001 - the page's error, whatever it is, is the answer
    error = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
    if out.getvalue():
      error += "\nThe block printed before it failed:\n" + out.getvalue()
    return error, out.getvalue()
  return None, out.getvalue()


def main() -> None:
  requests = os.fdopen(os.dup(0), "r")
  answers = os.fdopen(os.dup(1), "w")
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  os.dup2(2, 1)  # the answers keep the original stdout; the page's own writes go to stderr
  namespace: dict[str, Any] = {"__name__": "__main__"}
  printed = ""
  for line in requests:
    request = json.loads(line)
    if "skip" in request:
      try:
        answer = {"skip": _skip_reason(request["skip"], namespace)}
      except Exception:  # noqa: BLE001
        answer = {"error": traceback.format_exc()}
    else:
      error, printed = _run(request, namespace, printed)
      answer = {"error": error}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()


main()
