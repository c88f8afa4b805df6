"""Every *use* of a trainable parameter in the forward pass, and whether a hook saw it.

Hooks on modules see calls of modules, not uses of parameters. Real model code uses
parameters in other places too (nanoGPT's tied head ``F.linear(h, self.wte.weight)``, a
parent reading a child's weight, ``self.fc.forward(x)`` which bypasses the module's hooks,
``torch.nn.utils.parametrize`` computing a weight from its ``original``). A per-layer rule
applied to the recorded calls alone then returns a plausible, wrong per-sample gradient.

``UseTracker`` is a ``torch.overrides.TorchFunctionMode``: every torch function called
during the forward pass passes through it, wherever it is called. For each call that takes a
trainable parameter and returns something differentiable, it notes where the parameter was
used: inside the forward of a recorded layer that owns it (a *covered* use: the layer's rule
accounts for it) or anywhere else (an *uncovered* use: its per-sample gradient must come from
an exact method). It also notes randomness (dropout), which decides how the result can be
checked (``selfcheck.py``) and how the exact fallback runs (``fallback.py``: the batch's
random state replayed): a random function by name, and any draw from the default generators
between the tracker's entry and exit (their states compared: ``scaled_dot_product_attention``
with ``dropout_p > 0``, Llama's only dropout, draws under no listed name). A parameter
used only inside a ``torch.autograd.Function`` is not seen at all (``unseen.py`` finds it in
the graph afterwards).

Given the recorder, it also turns these uses into rule calls instead of uncovered ones:
``F.linear(x, W)`` of a parameter outside its layer (a tied head: ``tied.py``),
``F.embedding(x, W)`` likewise (the lookup of an Embedding subclass: ``tied.py``), and a
position-wise layer called without the batch whose output is added to a batched tensor (a
positional embedding on ``arange(T)``: ``broadcast.py``). It follows which tensors are a batch
flattened sample-major to (n·T, ...) rows (``flat_rows.py``), so a position-wise layer called on
them (OPT's MLP) is recorded as the call on (n, T, ...).

**Cost.** The mode sees every torch call of the forward pass, the workbench's own too: its
hooks read shapes, register tensor hooks and tap outputs, several times more calls than the
model itself makes, none of them a use of a parameter. ``quiet`` runs those hooks with
torch-function dispatch off, so the tracker sees the model's calls only; its body is a scan
of the arguments by id, the rest only for calls that take a tracked parameter or a watched
batch-free output.
"""

import torch
from torch.compiler import is_compiling
from torch.overrides import TorchFunctionMode

from workbench.errors import UnsupportedLayerError
from workbench.per_sample import batch_reductions, host_random, precision
from workbench.per_sample.broadcast import ADDS, REWRITES, BatchFree
from workbench.per_sample.derived import Derived, follow_parameters, graph_nodes
from workbench.per_sample.flat_rows import FOLLOWED, ROW_WRITES, FlatRows, in_place
from workbench.per_sample.leaves import leaves
from workbench.per_sample.precision import tolerance_of
from workbench.per_sample.registry import find_grad_sampler
from workbench.per_sample.tied import FUNCTIONAL, settle_broadcast, use_views

RANDOM_FUNCTIONS = {
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "native_dropout", "bernoulli", "bernoulli_", "rand", "randn", "randint", "rand_like",
    "randn_like", "randint_like", "normal", "normal_", "uniform_", "multinomial", "randperm",
    "rrelu", "rrelu_", "poisson", "exponential_", "random_", "cauchy_", "log_normal_",
    "geometric_",
}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
             "feature_alpha_dropout"}
_OUTSIDE = "<outside any layer's forward>"
LOSS = "<the loss function>"


def generator_states() -> tuple:
    """The default generators' states: CPU, and every initialised CUDA device's."""
    cuda = tuple(torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_initialized() else ()
    return torch.get_rng_state(), cuda


def advanced(before: tuple) -> bool:
    """Did a default generator draw since ``before`` (``generator_states``)?"""
    after = generator_states()
    return not torch.equal(before[0], after[0]) or len(before[1]) != len(after[1]) or any(
        not torch.equal(a, b) for a, b in zip(before[1], after[1]))


def _is_random(name: str, args, kwargs) -> bool:
    if name not in RANDOM_FUNCTIONS:
        return False
    if name in _DROPOUTS:  # F.dropout(x, p, training): random only when training and p > 0
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        return bool(training) and float(p) > 0
    return True


def _argument_ids(args, kwargs) -> list[int]:
    """ids of the arguments, one level into lists and tuples (as ``UseTracker._parameters_in``)."""
    ids = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) in (list, tuple):
            ids.extend(map(id, a))
        else:
            ids.append(id(a))
    return ids


def _differentiable(result) -> bool:
    if isinstance(result, torch.Tensor):
        return result.requires_grad
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves(result))


def quiet(hook):
    """``hook`` run with torch-function dispatch off (``torch._C.DisableTorchFunction``): for
    the workbench's own hooks, whose tensor calls (shapes, ``register_hook``, ``requires_grad_``
    of a layer's parameters) are book-keeping, not uses of the model; no mode on the stack (the
    use tracker, the loss watch) sees them. Not for code whose result the model receives if it
    may be a tensor subclass (dispatch off, an op returns a plain Tensor)."""
    def run(*args, **kwargs):  # no functools.wraps: a hook is wrapped on every record()
        with torch._C.DisableTorchFunction():
            return hook(*args, **kwargs)

    return run


QUERIES = frozenset({  # methods answering a question about a tensor's layout with no tensor:
    # no parameter use, no write, no draw; the use tracker lets them through unseen (HF code
    # asks x.size() and x.dim() at every layer; half the ops of a LayerNorm's record())
    "dim", "ndimension", "size", "__len__", "numel", "nelement", "stride", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "get_device", "storage_offset",
    "data_ptr"})


BY_FREQUENCY = frozenset({"embedding", "embedding_bag"})


def by_frequency(name: str, where: str) -> UnsupportedLayerError:
    """``F.embedding``/``F.embedding_bag`` with ``scale_grad_by_freq=True``, called anywhere
    (an EmbeddingBag, a bare Parameter, an Embedding subclass passing it on): the backward
    divides each token's gradient by its count in the *batch*, so the batch's gradient is no
    sum of the records' own (ghost's clipped sum 0.13-0.16 off, silently, until 2026-11-30;
    ``rules/embedding.check_embedding`` refused the plain ``nn.Embedding`` only)."""
    return UnsupportedLayerError(
        f"F.{name}(..., scale_grad_by_freq=True) in "
        f"{repr(where) if where and not where.startswith('<') else where or 'the model'}: "
        f"its backward divides each "
        f"token's gradient by the token's count in the whole batch, so a record's gradient "
        f"depends on the other records' tokens and no per-sample gradient is the batch's. "
        f"Drop scale_grad_by_freq (or scale by frequencies of the data set, computed once)")


HOOKS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})  # a tensor's
# gradient hooks: the pass's trace names them (``UseTracker._hooked``)

MULTIPLIES = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "lerp", "lerp_",
                        "addcmul", "addcmul_", "addcdiv", "addcdiv_", "div", "__truediv__"})


def gated_off(name: str, args, kwargs) -> bool:
    """The op takes a factor of 0: a float 0.0 anywhere (``lerp(h, m, 0.0)``, ``add(h, m,
    alpha=0.0)``, a NumPy float), an int 0 in a product (ints elsewhere are dims and sizes),
    a 0-d tensor on the CPU that is 0 or False (a gate held in a buffer, ``torch.where``'s
    condition). Part of the trace, so a term switched on by a schedule (``h + self.mix *
    h.mean(0)``, ``mix`` 0.0 at the checked step, 0.5 from step 4: 0.18 off, silently, until
    2026-11-30) is a new signature, checked again; a constant factor is one signature for
    good. Not seen: a gate on a GPU (its value costs a host sync per op), or one that is
    tiny rather than 0 at the checked step."""
    for a in args:
        if _zero(a, name):
            return True
    return any(_zero(v, "") for v in kwargs.values()) if kwargs else False


def _zero(a, name: str) -> bool:
    t = type(a)
    if t is float or t is bool:
        return not a
    if t is int:
        return a == 0 and name in MULTIPLIES
    if isinstance(a, torch.Tensor):
        return a.dim() == 0 and a.device.type == "cpu" and not a.requires_grad and not bool(a)
    if isinstance(a, float) or (t.__module__ == "numpy" and getattr(a, "ndim", None) == 0
                                and t.__name__.startswith(("float", "bool"))):
        return not a
    return False


class UseTracker(TorchFunctionMode):
    """Records uncovered uses of trainable parameters and random functions.

    Args:
        owners: {id(param): set of paths of the recorded layers that own it directly}.
        recorder: the ``hooks.ActivationRecorder`` of the forward pass (its ``stack``: the
            paths of layers whose forward is running; its calls: where functional calls and
            batch-free calls are recorded).
        names: {id(param): name}, for the paths of functional layers.
    """

    def __init__(self, owners: dict[int, set[str]], recorder, names=None):
        super().__init__()
        self.owners, self.recorder, self.stack = owners, recorder, recorder.stack
        self.names = names or {}
        self.uncovered: dict[int, set[str]] = {}  # id(param) -> where it was used
        self.random = False
        self.lowered = None  # the narrowest float dtype a wider float was cast to (precision.py)
        self.in_loss = False  # set while loss_fn runs: a use there is the loss's own
        self.loss_drew = False  # loss_fn drew from a generator of its own
        self.state = None  # state_replay.PassLog of the pass, when its owner keeps one
        self.batch_free = BatchFree()
        self.covered: set[int] = set()  # ids of parameters used inside an owner (tied.py)
        self.seen: set[int] = set()  # ids of parameters any differentiable op took (unseen.py)
        self.broadcast: list = []  # parameters broadcast into the batch (tied.py)
        self.views: dict = {}  # id(v) -> (ref, p, where): views of p not used yet (tied.py)
        self.flat_rows = FlatRows()  # rows of a batch flattened to (n·T, ...) (flat_rows.py)
        self.derived = Derived(owners)  # parameter-only tensors meeting the batch (derived.py)
        self._ruled: dict[str, bool] = {}  # path -> the layer has a grad rule (_inside_rule)
        self.trace = 0  # a hash of the names of the pass's ops in order: part of the
        # self-check's call signature (``selfcheck.signature``)
        self.hooks: list[str] = []  # the gradient hooks the pass registered (``_hooked``)
        self.reductions: list = []  # (result, x, what): statistics over the records with
        # gradient (``batch_reductions.py``), measured where the outputs reach one
        self.loss_stats = None  # while loss_fn runs in the functional API: the window's
        # ``dpsgd.loss_terms.BatchStatistics``, following each op (``recording.record``)
        self.loss_reductions: list = []  # the same notes as ``reductions``, taken in loss_fn
        self.loss_rows = None  # while loss_fn runs in the functional API: the optimizer's
        # row proof of the loss (``dpsgd.loss_rows.LossRows``), following each op

    def __enter__(self):
        self.recorder.batch_free = self.batch_free
        self.recorder.derived = self.derived  # kept after the pass: its hooks and results
        self.covered, self.broadcast, self.views, self.seen = set(), [], {}, set()
        self._ruled = {}
        self.flat_rows = self.recorder.flat_rows = FlatRows(self._tainted)
        with torch._C.DisableTorchFunction():
            self._states = generator_states()
        self._host = host_random.states()  # NumPy's and Python's: replayed by nothing
        follow_parameters(self.derived, True)  # nn.Parameter(batch statistic): tainted
        return super().__enter__()

    def __exit__(self, *exc):
        follow_parameters(self.derived, False)
        super().__exit__(*exc)
        if not self.random:  # a draw under any name (SDPA's dropout_p, a fused kernel)
            with torch._C.DisableTorchFunction():
                self.random = advanced(self._states)
        self.recorder.batch_free = self.recorder.flat_rows = None
        if exc[0] is None and (which := host_random.drew(self._host)) is not None:
            raise host_random.error(which)  # SpecAugment's masks: no twin can replay them
        if exc[0] is None:
            self.batch_free.finish(self.recorder)  # outside the mode: its ops are not uses
            settle_broadcast(self)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = self._use(func, types, args, kwargs)
        stats = self.loss_stats
        if stats is not None and self.in_loss and stats.on and not is_compiling() and (
                getattr(func, "__name__", "") != "__get__" or getattr(getattr(
                    func, "__self__", None), "__name__", None) in stats.ATTRIBUTES):
            with torch._C.DisableTorchFunction():  # the optimizer's loss window does the same
                result = stats.follow(func, args, kwargs or {}, result)  # (loss_watch.py)
        rows = self.loss_rows
        if rows is not None and rows.on and self.in_loss and not is_compiling() and \
                getattr(func, "__name__", "") != "__get__":  # an attribute: unfollowed, so
            with torch._C.DisableTorchFunction():  # what it makes is unproved (as there)
                rows.after(func.__name__, args, kwargs or {}, result, func)
        return result

    def _use(self, func, types, args=(), kwargs=None):
        """One op of the pass: its uses, rows, draws and writes followed."""
        kwargs = kwargs or {}
        if is_compiling():  # Dynamo traces the modes on the stack: the op alone (the
            return func(*args, **kwargs)  # private model's pass is refused: recorded.py)
        name = getattr(func, "__name__", "")
        if name in QUERIES:  # x.dim(), len(x), x.shape: a fact about a tensor, not a use
            return func(*args, **kwargs)
        if name in HOOKS:  # a gradient hook of the user's: b is read after it
            self._hooked(name, args)
            result = func(*args, **kwargs)
            if name == "register_hook" and args and isinstance(args[0], torch.Tensor) and \
                    self.recorder.capture == "edges":
                with torch._C.DisableTorchFunction():
                    self.recorder.hooked(args[0])
            return result
        if name == "__get__":  # an attribute: x.shape, x.dtype (no use) or x.T, x.data (one)
            if getattr(getattr(func, "__self__", None), "__name__", None) == "grad_fn":
                self._hooked("grad_fn", args)  # a node's hooks are set through it
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) or type(result) in (list, tuple):
                with torch._C.DisableTorchFunction():
                    return self._after(func, args, kwargs, result)
            return result
        if (func in REWRITES and self.batch_free.watched and torch.is_grad_enabled()
                and self.recorder.recording):
            args, kwargs = self.batch_free.rewrite(func, args, kwargs)  # T5's bias in SDPA
        if name in BY_FREQUENCY and kwargs.get("scale_grad_by_freq") and \
                torch.is_grad_enabled() and self.recorder.recording:
            raise by_frequency(name, self._where())
        pending = None
        if (self.derived.taint.refs and not self.in_loss and torch.is_grad_enabled()
                and self.recorder.recording and not self._inside_rule()):
            with torch._C.DisableTorchFunction():
                args, kwargs, pending = self.derived.rewrite(
                    func, args, kwargs, self._followed,
                    lambda p: func not in FUNCTIONAL and self._where() not in self.owners[id(p)])
        self.trace = hash((self.trace, name, gated_off(name, args, kwargs)))  # names: an
        # int argument may be n. The computation, not only its layers' shapes: a branch taken
        # on the data or a flag (h - h.mean(0) from step 2 on) is a new signature, checked
        # again (selfcheck.py), and so is a term whose Python factor leaves zero
        if self.state is not None:  # the model's state before the op writes it (state_replay)
            self.state.before(func, args, kwargs)
        if kwargs and isinstance(kwargs.get("generator"), torch.Generator):
            if self.in_loss:
                self.loss_drew = True  # a random loss: no halves check (selfcheck.py)
            elif self.stack:
                self._drew_from_own_generator()
        result = func(*args, **kwargs)  # the op itself: the modes below this one see it
        with torch._C.DisableTorchFunction():  # this mode's own reads of it: no mode's ops
            if pending is not None:
                self.derived.met(func, args, kwargs, pending, result, self.flat_rows.of)
                for p in pending[2]:  # a parameter handed over as D': its use is still one
                    self.seen.add(id(p))  # outside its layer (the fallback if the meeting
                    self._count(p, self._where())  # cannot give it)
            return self._after(func, args, kwargs, result)

    def _hooked(self, name: str, args) -> None:
        """A gradient hook registered in the pass (``h.register_hook``,
        ``register_post_accumulate_grad_hook``) or a node read to set one on (``h.grad_fn``:
        ``register_hook``, ``register_prehook``): part of the trace, so a hook switched on at
        a later step is a new signature, checked again (a hook mixing the records' backprops
        from step 4 on: 0.90 off, silently, until 2026-11-30), and named in a failed check."""
        self.trace = hash((self.trace, name))
        with torch._C.DisableTorchFunction():
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            shape = "" if t is None else f" of shape {tuple(t.shape)}"
        what = "a .grad_fn read (its node's hooks)" if name == "grad_fn" else f"{name}"
        self.hooks.append(f"{what} on a tensor{shape} in {self._where()}")

    def _drew_from_own_generator(self) -> None:
        """A draw from a ``torch.Generator`` of the model's (``generator=``) inside layers
        without a rule: their calls would draw other numbers when re-run alone (per-layer
        vmap), which ``hooks.draws`` (the default generators) does not see: they take the
        replayed fallback (``recording.DREW``), which sets the generator back
        (``state_replay``). 28% off with the check off until 2026-11-29."""
        layers = self.recorder.layers
        for path in self.stack:
            layer = layers.get(path)
            if layer is not None and find_grad_sampler(layer) is None:
                self.recorder.drew.add(path)

    def start(self, inputs) -> None:
        """A forward pass begins on ``inputs``, the model's tensors: each taints what it
        touches (``derived.py``) and carries the batch on dim 0, one row per sample
        (``flat_rows.py``: the rows a reshape may then flatten)."""
        self.trace = 0
        self.hooks = []
        self.reductions = []
        with torch._C.DisableTorchFunction():  # the tracker's own reads: no op of the pass
            self.derived.start(inputs)
            self.flat_rows.seed(inputs)

    def _inside_rule(self) -> bool:
        """The op runs inside the forward of a recorded layer with a rule (BiT's standardised
        weight meeting the batch in its conv): its own parameters are its rule's, any other
        one is a use outside its owner (the exact fallback), so no meeting is looked for."""
        if not self.stack:
            return False
        path = self.stack[-1]
        known = self._ruled.get(path)
        if known is None:
            layer = self.recorder.layers.get(path)
            known = self._ruled[path] = layer is not None and \
                find_grad_sampler(layer) is not None
        return known

    def _tainted(self, t) -> bool:
        """t may carry a sample: computed from the batch, or no batch known (no taint)."""
        taint = self.derived.taint
        return not taint.refs or taint.has(t)

    def _where(self) -> str:
        return LOSS if self.in_loss else self.stack[-1] if self.stack else _OUTSIDE

    def _followed(self, t, name: str, args=()) -> bool:
        """t is followed already, as a view of a parameter (``tied.use_views``), or by
        ``BatchFree`` (a batch-free layer output) in an add, which it converts: not a meeting's
        D. In any other op, or in an add with batch-flattened rows (Swin's window rows: its
        conversion would record the call on n·windows rows, not n), BatchFree would give it
        up (``poison``): it is, and t becomes D, whose meeting sums each sample's rows."""
        node = self.batch_free.watched.get(id(t))
        if node is not None and node.ref() is t:
            if name in ADDS and not any(
                    a is not t and isinstance(a, torch.Tensor) and (self.flat_rows.of(a) or
                                                                    (0, 1))[1] > 1
                    for a in args):
                return True
            node.entry.poisoned = True
            return False
        view = self.views.get(id(t))
        if view is not None and view[0]() is t:
            return True
        layer = self.recorder.layers.get(self.stack[-1]) if self.stack else None
        return layer is not None and any(v is t for v in vars(layer).values())  # an old-style
        # weight_norm's weight, set by the layer's pre-hook: the layer's own route takes it

    def _after(self, func, args, kwargs, result):
        """What one op of the forward pass tells the tracker; returns the op's result."""
        name = getattr(func, "__name__", "")
        if not self.random and name in RANDOM_FUNCTIONS:
            self.random = _is_random(name, args, kwargs)
        self._cast(args, result)  # every op: a cast, softmax(x, dtype=float32), and an op
        # that autocast ran narrower (an autocast block opened inside the model's forward)
        ids = _argument_ids(args, kwargs)  # one scan, then C-level set tests
        if name in ROW_WRITES and args and in_place(name) and isinstance(args[0], torch.Tensor):
            self.flat_rows.clean = None if self._tainted(args[0]) else id(args[0])  # before
            # the write taints it: a fresh buffer's rows (flat_rows._row_writes)
        if self.derived.taint.refs:
            self.derived.taint.spread(name, ids, args, kwargs, result)
        if name in FOLLOWED or (self.flat_rows.tags and in_place(name)):  # gradients on or
            self.flat_rows.after(name, args, kwargs, result)  # off: a custom autograd.Function's
            # forward runs without them, and returns the very tensor its ops made (BLOOM's GELU)
        if torch.is_grad_enabled():
            if name in batch_reductions.NOTED and (not self.in_loss or self.loss_stats):
                self._over_records(name, args, kwargs, result)
            watched = self.batch_free.watched
            if watched and not watched.keys().isdisjoint(ids):
                self.batch_free.saw(func, args, kwargs, result, _differentiable)
            if (self.views and _differentiable(result) and not self.views.keys().isdisjoint(ids)
                    and use_views(self, func, args, kwargs, result, self._count)):
                return result  # a layer scale x * p.reshape(...): a rule call (tied.py)
            if self.owners.keys().isdisjoint(ids):
                return result  # no tracked parameter among the arguments: the usual op
            used = self._parameters_in(args, kwargs)
            if used and result is used[0] and not in_place(name):
                return result  # p.to(p.dtype), p.float() on a float32 p: p itself, no op;
                # its uses are those of what it flows into (Mamba-2's dt_bias.to(dt.dtype))
            if used and _differentiable(result):
                self.seen.update(map(id, used))
                where = LOSS if self.in_loss else self.stack[-1] if self.stack else _OUTSIDE
                functional = FUNCTIONAL.get(func)
                if (functional is not None and not self.in_loss and self.recorder.recording
                        and functional(self, args, kwargs, result, where, func)):
                    return result  # a tied head, an Embedding's lookup: a rule call (tied.py)
                for p in used:
                    self._count(p, where)
        return result

    def _over_records(self, name, args, kwargs, result) -> None:
        """A max, norm, std... over the records: noted with its node (``batch_reductions``)."""
        held = batch_reductions.noted(result)
        if held is not None and batch_reductions.over_records(
                name, args, kwargs, self.flat_rows.of):
            where = self._where()
            where = f"called at {batch_reductions.caller()}" + (
                "" if where.startswith("<") else f", inside layer {where!r}")
            notes = self.loss_reductions if self.in_loss else self.reductions
            notes.append((held, args[0],
                          f"torch's {name} over dim 0 (the records) of a "
                          f"{tuple(args[0].shape)} tensor computed from the batch, {where}",
                          self.flat_rows.of(args[0])[0]
                          if name in batch_reductions.LINEAR else None))

    def refuse_mixing(self, outputs, paused) -> None:
        """The forward pass ended with ``outputs`` (tensors): ``SampleMixingError`` if their
        gradient depends on a statistic over the records (``batch_reductions``); ``paused``:
        the recorders' pause, for the measuring gradient passes."""
        notes, self.reductions = self.reductions, []
        with torch._C.DisableTorchFunction():
            batch_reductions.refuse_reached(notes, outputs, graph_nodes, paused,
                                            tolerance_of)

    def _cast(self, args, result) -> None:
        """An op whose float result is narrower than its float input (Hugging Face's RMSNorm
        computes in ``hidden_states.to(torch.float32)`` whatever the model's dtype; an op
        given a narrower ``dtype=``, ``F.softmax(x, -1, dtype=torch.float32)``; a Linear run
        by an autocast block the model's forward opens itself, which the pre-hook's autocast
        state does not see: a correct bfloat16 pass was refused at float32's tolerance until
        2026-11-30): the forward pass computes partly in that precision, so its checks use
        its tolerance (``precision.compared_dtype``), not the parameters' dtype's."""
        dtype = precision.lowered_by(args, result)
        if dtype is not None and (self.lowered is None
                                  or dtype.itemsize < self.lowered.itemsize):
            self.lowered = dtype

    def _count(self, p, where: str) -> None:
        """One use of p at ``where``: covered inside an owner, else uncovered."""
        if where not in self.owners[id(p)]:
            self.uncovered.setdefault(id(p), set()).add(where)
        else:
            self.covered.add(id(p))

    def _parameters_in(self, args, kwargs) -> list:
        """The tracked parameters among the arguments (one level into lists and tuples:
        ``torch.cat([w1, w2])``, the weight lists of fused RNN kernels). A scan by id, the
        cheap part of a call that runs for every op of the forward pass."""
        owners, used = self.owners, []
        for a in (*args, *kwargs.values()):
            if id(a) in owners:
                used.append(a)
            elif type(a) in (list, tuple):
                used.extend(b for b in a if id(b) in owners)
        return used


__all__ = ["HOOKS", "LOSS", "RANDOM_FUNCTIONS", "UseTracker", "advanced", "gated_off",
           "generator_states", "quiet"]
