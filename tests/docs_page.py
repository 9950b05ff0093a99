"""The interpreter a docs page runs in: a fresh `python` in the repository's root, one per page.

The root conftest.py starts it (`python -c` with this file's text, so that the page sees the
`sys.path` a reader's `python` started in the root has) and sends it the page's blocks in page
order, one JSON request a line on stdin; each gets one JSON answer a line on the stdout the
interpreter started with:

* `{"source", "path", "line", "hidden"}` runs a block (`line`: the page line before its first
  one, so tracebacks name page lines). A visible block runs as a reader who copies it alone
  runs it: in a fresh namespace (`__name__ == "__main__"`), unless its first line is a comment
  that says it `continues the block above`; then it runs in the namespace the visible block
  above it left, as it would after that one in the reader's interpreter. It must print
  something, so that its reader sees it worked. (The page's interpreter is one process: the
  modules a block above imported are loaded, so what a fresh namespace checks is the names a
  block uses, not the cost of its imports.) A hidden block (`invisible-code-block`) runs in a
  copy of the namespace the visible block above it left, with `printed` (what that block
  printed) added: it may check what that block made, but nothing it defines or imports
  reaches a later block, so a page cannot pass on setup its reader does not see. Answer:
  `{"error": null}`, or the traceback (and what the block printed) as text.
* `{"skip"}` evaluates a skip directive's argument (`"reason"` or `if(condition,
  reason="...")`, Sybil's syntax) in the namespace the visible block above it left. Answer:
  `{"skip": reason or null}`.

What the page writes to the file descriptors 1 and 2 goes to this process's stderr.
"""

import contextlib
import io
import json
import os
import re
import traceback
from typing import Any


# A block's first line that makes it run after the block above it, in that block's namespace.
CONTINUES = re.compile(r"\s*#.*\bcontinues the block above\b")
ALONE = ("\nA block runs alone, as a reader who copies it runs it: import or define what it "
         "uses, or start it with `# continues the block above`.")
SILENT = ("the block printed nothing, so a reader who runs it cannot tell it worked: print "
          "what it made (a value its comments show, a shape, stats).")


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


def _run(request: dict[str, Any], scope: dict[str, Any]) -> tuple[str | None, str]:
  """Runs one block in `scope`; returns (the error's text or None, what the block printed)."""
  out = io.StringIO()
  try:
    code = compile("\n" * request["line"] + request["source"], request["path"], "exec",
                   dont_inherit=True)
    with contextlib.redirect_stdout(out):
      exec(code, scope)
  except BaseException as e:  # noqa: BLE001 - the page's error, whatever it is, is the answer
    error = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
    if isinstance(e, NameError) and not request["hidden"]:
      error += ALONE
    if out.getvalue():
      error += "\nThe block printed before it failed:\n" + out.getvalue()
    return error, out.getvalue()
  if not request["hidden"] and not out.getvalue():
    return SILENT, ""
  return None, out.getvalue()


def _scope(request: dict[str, Any], above: dict[str, Any], printed: str) -> dict[str, Any]:
  """The namespace a block runs in, given the one the visible block above it left."""
  if request["hidden"]:
    return dict(above, printed=printed)
  if CONTINUES.match(request["source"].partition("\n")[0]):
    return above
  return {"__name__": "__main__"}


def main() -> None:
  requests = os.fdopen(os.dup(0), "r")
  answers = os.fdopen(os.dup(1), "w")
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  os.dup2(2, 1)  # the answers keep the original stdout; the page's own writes go to stderr
  namespace: dict[str, Any] = {"__name__": "__main__"}  # the last visible block's,
  printed = ""                                           # and what it printed
  for line in requests:
    request = json.loads(line)
    if "skip" in request:
      try:
        answer = {"skip": _skip_reason(request["skip"], namespace)}
      except Exception:  # noqa: BLE001
        answer = {"error": traceback.format_exc()}
    else:
      scope = _scope(request, namespace, printed)
      error, out = _run(request, scope)
      if not request["hidden"]:
        namespace, printed = scope, out
      answer = {"error": error}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()


main()
