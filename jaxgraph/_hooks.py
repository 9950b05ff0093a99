"""Host hooks: `Hooks`, `HookEvent`, their validation and invocation, and `is_capturing`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import threading
from typing import Any, Callable, Iterator, Literal, Sequence

Phase = Literal["warmup", "capture", "replay"]
HookKind = Literal["pre_forward", "forward", "pre_backward", "backward"]
HOOK_KINDS: tuple[HookKind, ...] = ("pre_forward", "forward", "pre_backward", "backward")


@dataclasses.dataclass(frozen=True)
class HookEvent:
  """What a hook is told. Built on the host, outside any trace.

  Attributes:
    index: position of the callable in the sequence given to `make_graphed`.
    phase: "warmup", "capture" or "replay".
    iteration: the warmup iteration; 0 at capture; the callable's forward count at replay
      (a backward reports the iteration of its forward).
    microbatch: the microbatch of a pipeline `order`; 0 without one.
    args: the positional arguments of the forward (at capture: `jax.ShapeDtypeStruct`s).
    outputs: the callable's own output pytree (`forward` and later; abstract at capture).
    cotangents: the cotangent pytree (`pre_backward`, `backward`).
    grads: the tuple of gradients, one per positional argument (`backward`).
  """

  index: int
  phase: Phase
  iteration: int
  microbatch: int
  args: tuple[Any, ...]
  outputs: Any = None
  cotangents: Any = None
  grads: Any = None


Hook = Callable[[HookEvent], None]


class Hooks:
  """Lists of host hooks, each called as `hook(event)` with one `HookEvent`.

  Args:
    pre_forward: run before the forward executable.
    forward: run after the forward executable, with its outputs.
    pre_backward: run before the backward executable, with the cotangents.
    backward: run after the backward executable, with the grads.

  A hook must return None. Hooks never run inside a trace: when a graphed callable is called
  with tracers (inside a user's `jax.jit`) it runs its Python function and fires no hook.
  """

  __slots__ = HOOK_KINDS

  def __init__(self, *, pre_forward: Sequence[Hook] = (), forward: Sequence[Hook] = (),
               pre_backward: Sequence[Hook] = (), backward: Sequence[Hook] = (),
               **unknown: Any):
    if unknown:
      name = next(iter(unknown))
      # torch's names: the hook after the forward is `forward` here, not `post_forward`
      close = ([name.removeprefix("post_")] if name.removeprefix("post_") in HOOK_KINDS
               else difflib.get_close_matches(name, HOOK_KINDS, n=1))
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise TypeError(f"Hooks got an unknown hook kind {name!r}; the kinds are "
                      f"{', '.join(HOOK_KINDS)}.{hint}")
    for kind, hooks in zip(HOOK_KINDS, (pre_forward, forward, pre_backward, backward)):
      if isinstance(hooks, dict):
        raise TypeError(f"Hooks({kind}=...) takes a list of hooks, got a dict. Pass "
                        f"Hooks({kind}=list(your_dict.values())).")
      if callable(hooks):
        hooks = [hooks]
      hooks = tuple(hooks)
      for hook in hooks:
        if not callable(hook):
          raise TypeError(f"Hooks({kind}=...) must hold callables, got {hook!r}.")
      object.__setattr__(self, kind, hooks)

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError("Hooks is immutable; build a new one.")

  def __repr__(self) -> str:
    parts = [f"{kind}={list(getattr(self, kind))!r}" for kind in HOOK_KINDS if getattr(self, kind)]
    return f"Hooks({', '.join(parts)})"

  def __add__(self, other: Hooks) -> Hooks:
    """Both sets of hooks, `self`'s first for every kind."""
    return Hooks(**{kind: getattr(self, kind) + getattr(other, kind) for kind in HOOK_KINDS})


NO_HOOKS = Hooks()


def by_phase(hooks: Hooks, capture_time_hooks: Hooks) -> dict[Phase, Hooks]:
  """The hooks of one callable that fire in each phase: `hooks` on replay; in warmup and
  capture the capture-time hooks too, first (Transformer Engine's order)."""
  merged = capture_time_hooks + hooks
  return {"warmup": merged, "capture": merged, "replay": hooks}


def per_callable(hooks: Hooks | Sequence[Hooks | None] | None, count: int,
                 argument: str) -> tuple[Hooks, ...]:
  """One `Hooks` per callable from None, one `Hooks` for all, or a sequence of `count`."""
  if hooks is None:
    return (NO_HOOKS,) * count
  if isinstance(hooks, Hooks):
    return (hooks,) * count
  if isinstance(hooks, dict):
    raise TypeError(f"{argument} takes jaxgraph.Hooks (or a sequence of them, one per "
                    f"callable), not a dict: write Hooks(pre_forward=[...], forward=[...]).")
  if not isinstance(hooks, Sequence) or isinstance(hooks, str):
    hint = (" For a single hook function write Hooks(pre_forward=[fn])."
            if callable(hooks) else "")
    raise TypeError(f"{argument} takes jaxgraph.Hooks (or a sequence of them, one per "
                    f"callable), got {type(hooks).__name__}.{hint}")
  hooks = tuple(hooks)
  if len(hooks) != count:
    raise ValueError(f"{argument} has {len(hooks)} entries but there are {count} callables; "
                     "pass one Hooks (or None) per callable, or a single Hooks for all.")
  for i, entry in enumerate(hooks):
    if entry is not None and not isinstance(entry, Hooks):
      raise TypeError(f"{argument}[{i}] must be jaxgraph.Hooks or None, got "
                      f"{type(entry).__name__}.")
  return tuple(NO_HOOKS if entry is None else entry for entry in hooks)


def _hook_name(hook: Hook) -> str:
  return getattr(hook, "__qualname__", None) or repr(hook)


def fire(hooks: tuple[Hook, ...], kind: HookKind, event: HookEvent, owner: str) -> None:
  """Call every hook with `event`; a non-None return value or an exception names the hook."""
  for hook in hooks:
    try:
      result = hook(event)
    except BaseException as e:
      e.add_note(f"raised by {kind} hook {_hook_name(hook)} of {owner} "
                 f"(phase={event.phase}, iteration={event.iteration})")
      raise
    if result is not None:
      raise TypeError(f"{kind} hook {_hook_name(hook)} of {owner} returned "
                      f"{type(result).__name__}; hooks must return None (they observe, they "
                      "cannot replace arguments or results).")


# Per thread: a thread replaying while another one runs make_graphed is not capturing.
_capture_state = threading.local()


def is_capturing() -> bool:
  """True while `make_graphed` warms up or captures in this thread; False otherwise, also
  after an error."""
  return getattr(_capture_state, "depth", 0) > 0


@contextlib.contextmanager
def capturing() -> Iterator[None]:
  """Marks warmup and capture for `is_capturing`; always unset on exit, error or not."""
  _capture_state.depth = getattr(_capture_state, "depth", 0) + 1
  try:
    yield
  finally:
    _capture_state.depth -= 1
