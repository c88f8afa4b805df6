"""The model's state as a forward pass read it, for every route that runs the forward again.

Every exact twin re-runs the model after the batch's pass: the self-check's probe (one record
alone, or the batch with the others substituted), the whole-model fallback (vmap, replayed
rows, micro-batching), ghost clipping's second pass. Each assumes the re-run computes what the
batch's pass computed. A forward pass that writes the model's state without the batch's values
breaks that: the old ``torch.nn.utils.spectral_norm`` advances its power iteration
(``weight_u``, ``weight_v``) in place at each training-mode call, a layer counts its calls in
a buffer, a scale kept as an attribute is rebound. Re-run after the pass, the forward reads
what the pass left, not what it read: until 2026-11-29 the fallback's clipped sums of a
spectral-normed layer were 12-40% off with the self-check off, silently, and the self-check
refused such models with a message that blamed the rules. (A write *from* the batch's values
is refused outright: ``checks.state_written_from_batch``.)

Invariant: **a re-run reads the state the batch's pass read, and leaves the state the pass
left.** One mechanism keeps it for every re-run:

* ``PassLog`` (opened at each recorded forward pass's start, by the use tracker of the
  optimizer's pass and of ``recording.record``) keeps every module's attribute bindings as the
  pass found them (identities: cheap) and, copy on write, the value of each buffer, tensor
  attribute or parameter just before the pass first writes it in place: the tracker calls
  ``before`` ahead of every op that writes its first argument (``x.op_``, ``x += a``,
  ``x[k] = a``, ``t.data = v``) or an ``out=`` tensor, matched by storage, so a write through
  ``.data`` or a view is caught as well. A write no mode sees (C++, torch-function dispatch
  off) still moves the tensor's version counter: such a tensor is ``unseen``, and a re-run
  that would read it is refused with its name, never run on a wrong state.
* ``replayed(log)`` around a re-run: the pass's starting bindings are put back, and each
  tensor the pass wrote is replaced, where the model binds it, by a copy of the value the pass
  read; after the re-run (also when it raises) the post-pass bindings are restored. The
  tensors the pass left are never written, so the batch's autograd graph and the re-run's
  (whose backward pass may come after, as ghost clipping's does) each keep the values they
  saved. A parameter written in place (it cannot be swapped: the gradients are taken with
  respect to it) has its values put back through ``.data``.
* micro-batching runs one forward per record: ``Snapshot.rewind`` puts the state back before
  each (``microbatch.py``), so record i does not read what records 0..i-1 wrote.

A ``torch.Generator`` the forward draws from by ``generator=`` (a layer's own noise source) is
state too: its state before the pass's first draw from it is kept and set again for each
re-run, and the state the pass left is restored after (the default generators are replayed by
``fallback.replayed``).

The training modes are state as well: a re-run, and every decision the step makes after the
pass, uses the modes the pass ran in (``modes``; a loop's ``model.eval()`` before ``step()``).
State the loop writes in place after the pass (``PassLog.ended``: version counters) cannot be
read as the pass read it: a re-run that needs it is refused by name (``replayable``).

The model's own module hooks are state as well (``_model_hooks``): a forward pass may register
them lazily and mark that it did with an attribute (transformers' output capture); a re-run
takes both back to the pass's start and leaves both as the pass left them, the workbench's own
hooks (``hooks.OwnHook``) untouched.

Not covered: state outside the model (globals, closures) and Python containers mutated in
place (a list a forward appends to).
"""

from contextlib import contextmanager

import torch
from torch import nn

from workbench.errors import UnsupportedLayerError
from workbench.per_sample.derived import _storage, writes_first
from workbench.per_sample.hooks import _MODULE_KEYS, OwnHook  # torch's own slots: hook tables


def _bindings(m: nn.Module) -> tuple:
    d = m.__dict__
    return ({k: v for k, v in d.items() if k not in _MODULE_KEYS}, dict(d["_buffers"]),
            dict(d["_parameters"]), d["training"], _model_hooks(d))


_HOOKS = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
          "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
          "_backward_hooks": (), "_backward_pre_hooks": ()}  # table -> its flag tables


def _model_hooks(d: dict) -> tuple:
    """The module hooks of a module's ``__dict__`` ``d`` that are not the workbench's own
    (``hooks.OwnHook``): ((table, key, hook, flags), ...), () where none (the usual layer).
    The model's hooks are state a forward pass may write: transformers' output capture
    (``capture_outputs``: Whisper's, Wav2Vec2's and HuBERT's classifiers ask for every hidden
    state) registers its forward hooks on the first call that asks, and marks the model with
    an attribute. A re-run that took the attribute back (it was added during the pass) but
    kept the hooks installed them a second time: every hidden state was captured twice, then
    three times, and the weighted layer sum failed on one record (``tensor a (4) must match
    the size of tensor b (2)``), refused as "cannot run on one record alone" until
    2026-12-01 (``/work/runs/audio/repro_a.py``)."""
    out = ()
    for name in _HOOKS:
        table = d.get(name)
        if table:
            for k, h in table.items():
                if type(h) is not OwnHook:  # (a dict walk per module and pass: kept cheap)
                    out += ((name, k, h, tuple(k in d[f] for f in _HOOKS[name])),)
    return out


def _rehook(d: dict, saved: tuple) -> None:
    """Put the model's own module hooks of ``d`` back to ``saved`` (``_model_hooks``), the
    workbench's own left as they are (the recording's, a probe's: registered for the re-run).
    A hook taken out and put back goes after the others of its table."""
    now = _model_hooks(d)
    if len(now) == len(saved) and all(a[:2] == b[:2] and a[2] is b[2]
                                       for a, b in zip(now, saved)):
        return
    keep = {(name, k) for name, k, _, _ in saved}
    for name, k, _, _ in now:
        if (name, k) not in keep:
            for table in (name, *_HOOKS[name]):
                d[table].pop(k, None)
    for name, k, h, flags in saved:
        if d[name].get(k) is not h:
            d[name][k] = h
            for table, on in zip(_HOOKS[name], flags):
                if on:
                    d[table][k] = True


def _computed(t) -> bool:
    return isinstance(t, torch.Tensor) and t.grad_fn is not None


def _rebind(m: nn.Module, bindings: tuple, keep_computed: bool = False) -> None:
    """Put ``m``'s attribute, buffer and parameter bindings and its training flag back to
    ``bindings``.
    ``keep_computed``: an attribute bound to a tensor computed with a graph (the old
    ``weight_norm``'s ``weight``, set by its pre-hook at every call) keeps the re-run's, equal
    in value (the re-run read the pass's state) and with its graph alive, which the batch's
    backward pass has freed (a per-layer re-run differentiates through it)."""
    attrs, buffers, params, training, hooks = bindings
    d = m.__dict__
    _rehook(d, hooks)  # the model's own module hooks, with the attributes that stand for them
    d["training"] = training  # the pass's mode: a loop's model.eval() before step() would
    # otherwise re-run it without its dropout (72% off with the check off, until 2026-11-29)
    for k in [k for k in d if k not in _MODULE_KEYS and k not in attrs]:
        del d[k]  # added since
    for k, v in attrs.items():
        now = d.get(k, attrs)
        if now is not v and not (keep_computed and _computed(now) and _computed(v)):
            d[k] = v
    for table, saved in ((d["_buffers"], buffers), (d["_parameters"], params)):
        if table.keys() != saved.keys() or any(table[k] is not v for k, v in saved.items()):
            table.clear()
            table.update(saved)


def _tensor_attributes(m: nn.Module):
    """(table, key, tensor) of ``m``'s tensor attributes and buffers (not its parameters)."""
    d = m.__dict__
    for k, v in d.items():
        if isinstance(v, torch.Tensor) and k not in _MODULE_KEYS:
            yield d, k, v
    for k, v in d["_buffers"].items():
        if v is not None:
            yield d["_buffers"], k, v


def _usable(t: torch.Tensor) -> bool:
    """Not a tensor that escaped a torch.func transform (a forward run under vmap that bound a
    batched tensor to an attribute): every read of it raises; it is no state a pass reads."""
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _put(t: torch.Tensor, value: torch.Tensor) -> None:
    """t's values := value, through ``.data`` (its version counter does not move)."""
    with torch.no_grad():
        data = t.data
        if data.shape == value.shape and data.dtype == value.dtype and \
                data.device == value.device:
            data.copy_(value)
        else:  # ``t.data = v`` changed its shape or dtype during the pass
            t.data = value.clone()


def _sums(tensors) -> torch.Tensor:
    """(k, 2) float64: Σ t and ||t|| of each tensor (two numbers each, so a write that keeps
    the sum, a swap of two entries aside, still shows), without a copy of a float tensor
    (a bit-identical tensor gives bit-identical reductions: equality is the test)."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.float64)
    rows = []
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        elif not t.is_floating_point():  # an index or mask buffer: small, copied
            t = t.double()
        rows.append(torch.stack([t.sum(), torch.linalg.vector_norm(t)]).to(torch.float64))
        # in t's own dtype: with dtype=float64 both copy t to float64 first (measured: a
        # 200 MB float32 tensor raised the peak by 384 MB), at the activations' peak
    return torch.stack(rows)


class Snapshot:
    """The model's state now: every module's bindings, and (``values``) a copy of every buffer
    and tensor attribute; ``rewind()`` puts them back."""

    def __init__(self, model: nn.Module, values: bool = True):
        self.modules = [(m, _bindings(m)) for m in model.modules()]
        self.values = []
        if values:
            seen = set()
            for m, _ in self.modules:
                for _, _, t in _tensor_attributes(m):
                    if id(t) not in seen and _usable(t):
                        seen.add(id(t))
                        self.values.append((t, t.detach().clone()))

    def rewind(self, keep_computed: bool = False) -> None:
        for m, b in self.modules:
            _rebind(m, b, keep_computed)
        for t, v in self.values:
            _put(t, v)


class PassLog:
    """One recorded forward pass: the state it started from (bindings; values copied on first
    write), and what it wrote where no mode saw it (``unseen``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.storages: dict[int, list] = {}  # storage -> [(name, tensor)] of the model's state
        self.versions: dict[int, tuple] = {}  # id -> (name, tensor, version at start)
        self.places: dict[int, list] = {}  # id(t) -> [(table, key)] binding a tensor
        self.start = Snapshot.__new__(Snapshot)  # the bindings; one walk for all (every pass)
        self.start.modules, self.start.values = [], []
        for path, m in model.named_modules():
            d = m.__dict__
            attrs = {}
            for k, v in d.items():
                if k not in _MODULE_KEYS:
                    attrs[k] = v
                    if isinstance(v, torch.Tensor):
                        self._track(path, d, k, v)
            buffers, params = d["_buffers"], d["_parameters"]
            self.start.modules.append((m, (attrs, dict(buffers), dict(params),
                                           d["training"], _model_hooks(d))))
            for k, v in buffers.items():
                if v is not None:
                    self._track(path, buffers, k, v)
            for k, v in params.items():
                if v is not None:
                    self._track(path, None, k, v)
        self.saved: dict[int, tuple] = {}  # id(t) -> (name, t, value before the first write)
        self.unseen: list[str] = []
        self.ended: list = []  # (name, t, version) at the pass's end
        self.sums = None  # ``fingerprint``: ([(name, t)], their sums at the pass's end)
        self.generators: dict[int, tuple] = {}  # id -> (a torch.Generator the pass drew from
        # by ``generator=``, its state before the first draw): the default generators are
        # replayed by ``fallback.replayed``, these here

    def _track(self, path: str, table, key: str, t: torch.Tensor) -> None:
        if not _usable(t):
            return
        if table is not None:
            self.places.setdefault(id(t), []).append((table, key))
        if id(t) in self.versions:
            return
        name = f"{path}.{key}" if path else key
        ptr = _storage(t)
        if ptr is not None:
            self.storages.setdefault(ptr, []).append((name, t))
        self.versions[id(t)] = (name, t, t._version)

    def before(self, func, args, kwargs) -> None:
        """Ahead of an op: copy what it is about to write, if that is the model's state."""
        if args and isinstance(args[0], torch.Tensor) and \
                writes_first(getattr(func, "__name__", "")):
            self._save(args[0])
        if not kwargs:
            return
        out = kwargs.get("out")
        for t in (out if type(out) in (list, tuple) else (out,)):
            if isinstance(t, torch.Tensor):
                self._save(t)
        g = kwargs.get("generator")
        if isinstance(g, torch.Generator) and id(g) not in self.generators:
            self.generators[id(g)] = (g, g.get_state())  # before its first draw of the pass

    def _save(self, t: torch.Tensor) -> None:
        with torch._C.DisableTorchFunction():  # its own reads are no op of the pass
            self._save_quietly(t)

    def _save_quietly(self, t: torch.Tensor) -> None:
        for name, s in self.storages.get(_storage(t), ()):
            if id(s) not in self.saved:
                self.saved[id(s)] = (name, s, s.detach().clone())
                if s._version != self.versions[id(s)][2]:  # written unseen before this write
                    self.unseen.append(name)

    def close(self) -> None:
        """The pass ended: which state tensors changed without ``before`` seeing it."""
        self.unseen += [name for name, t, v in self.versions.values()
                        if t._version != v and id(t) not in self.saved]
        self.ended = [(name, t, t._version) for name, t, _ in self.versions.values()]
        self.storages, self.versions = {}, {}  # only during the pass

    def fingerprint(self) -> None:
        """Sums of every state tensor the pass did not write (no copy of a float one), to find a
        write after the pass that moves no version counter: ``p.data.mul_(0.9)``, weight
        decay by hand between backward and ``step()``, re-ran the fallback at other weights
        than the batch's (5% off with the check off, until 2026-11-29). One read of the model
        per pass: taken where a re-run is likely (the caller's choice)."""
        kept = [(name, t) for name, t, _ in self.ended if id(t) not in self.saved]
        self.sums = (kept, _sums([t for _, t in kept]))

    def written_after(self, parameters: bool = False) -> list[str]:
        """Names of the tensors of the model's state written in place since the pass ended
        (buffers and tensor attributes; ``parameters`` too)."""
        return [name for name, t, v in self.ended if t._version != v
                and (parameters or id(t) in self.places)]

    def replayable(self) -> None:
        later = [name for name, t, v in self.ended if t._version != v
                 and id(t) not in self.saved]  # a re-run reads a copy of those (replayed)
        if not later and self.sums is not None:  # also through .data: sums differ
            kept, before = self.sums
            with torch._C.DisableTorchFunction():
                now = _sums([t for _, t in kept])
            same = (now == before) | (now.isnan() & before.isnan())  # a NaN parameter
            if not bool(same.all()):  # is no write (the non-finite policy refuses it)
                later = [name for (name, _), row in zip(kept, same) if not bool(row.all())]
        if later:  # the loop (or a backward hook) wrote it after the pass: the value the
            # pass read is gone, and a re-run would read the new one
            raise UnsupportedLayerError(
                f"{', '.join(later[:3])} {'was' if len(later) == 1 else 'were'} written in "
                f"place after the forward pass that the step clips (between the forward pass "
                f"and optimizer.step(): in the loop or in a backward hook), so an exact twin "
                f"that runs the forward again (the self-check, the whole-model fallback, "
                f"ghost clipping's second pass) would read another value than the batch's "
                f"pass did. Write it after optimizer.step(), or inside the forward pass")
        if self.unseen:
            raise UnsupportedLayerError(
                f"the forward pass wrote {', '.join(self.unseen[:3])} in place where the "
                f"workbench could not see the write (inside C++ or with torch-function "
                f"dispatch off), so the value it read there is lost, and an exact twin that "
                f"runs the forward again (the self-check, the whole-model fallback) would read "
                f"another one. Keep that state fixed during private training (write it only "
                f"when not module.training), or compute it outside the forward pass")


@contextmanager
def replayed(log: PassLog | None):
    """Inside: the model's state as the pass ``log`` found it; after: as the pass left it
    (also when the re-run raises). ``None``: no pass logged, nothing changed."""
    if log is None:
        yield
        return
    log.replayable()
    after = Snapshot(log.model, values=False)
    params = [(t, t.detach().clone()) for _, t, _ in log.saved.values()
              if id(t) not in log.places]  # a parameter written in place in the pass
    drawn = [(g, g.get_state()) for g, _ in log.generators.values()]
    try:
        with torch._C.DisableTorchFunction():
            for g, state in log.generators.values():  # the numbers the pass drew
                g.set_state(state)
            log.start.rewind()
            for _, t, value in log.saved.values():
                places = log.places.get(id(t))
                if places is None:
                    _put(t, value)
                for table, key in places or ():
                    if table.get(key) is t:  # a copy of the value read, bound in t's place
                        table[key] = value.clone()
        yield
    finally:
        with torch._C.DisableTorchFunction():
            after.rewind(keep_computed=True)
            for t, value in params:
                _put(t, value)
            for g, state in drawn:  # as the pass left them: the loop's next draws unchanged
                g.set_state(state)


@contextmanager
def modes(log: PassLog | None):
    """Inside: every module in the training mode the pass ``log`` ran in; after: as before.
    What a step decides after the pass (a rule-less layer holding dropout takes the replayed
    fallback: ``fallback.redraws``; a layer re-run) must read the pass's modes, not the ones
    a loop set since (``model.eval()`` before ``optimizer.step()``: the fallback re-ran the
    batch without its dropout masks, 72% off with the check off, until 2026-11-29)."""
    if log is None:
        yield
        return
    changed = [(m, m.training) for m, b in log.start.modules if m.training != b[3]]
    if not changed:
        yield
        return
    for m, b in log.start.modules:
        m.training = b[3]
    try:
        yield
    finally:
        for m, mode in changed:
            m.training = mode


@contextmanager
def read_only_parametrizations(layer: nn.Module, cache: bool = True):
    """Inside: reading a parametrized tensor of ``layer`` (``layer.weight`` under
    ``torch.nn.utils.parametrize``) computes it once (``parametrize.cached``; every time with
    ``cache=False``: a per-layer vmap or micro-batching re-run differentiates it through the
    parameters it substitutes) with its parametrizations in eval mode. A rule reads
    ``layer.weight`` after the pass (its shape, its ``requires_grad``), and in training mode
    each read of a spectral-normed weight ran a power iteration, writing ``_u`` and ``_v``
    again: the model's state drifted by one iteration per rule call, and the weight read was not
    the one the forward used. In eval mode the parametrization computes from ``_u`` and ``_v``
    as the pass left them, which is the weight the pass computed last, and writes nothing."""
    plist = layer._modules.get("parametrizations")
    if plist is None:
        yield
        return
    modes = [(m, m.training) for m in plist.modules()]
    for m, _ in modes:
        m.training = False
    try:
        if cache:
            with torch.nn.utils.parametrize.cached():
                yield
        else:
            yield
    finally:
        for m, mode in modes:
            m.training = mode


__all__ = ["PassLog", "Snapshot", "modes", "read_only_parametrizations", "replayed"]
