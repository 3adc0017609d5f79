"""``fold-rotate``: the widest linear map a plain checkpoint carries exactly at a cut.

At a cut after kept block ``p`` the stream is ``h = r + m``: ``r`` what entered ``p``'s MLP, ``m = z W`` the MLP's
write (``z``: its hidden activations). ``fold`` changes only ``W``. An RMSNorm also commutes with a scale times a
rotation, ``x -> s x Q`` (``Q`` orthogonal, ``s > 0``), once its gain is folded into the linears that read it:
``norm(s x Q) = norm(x) Q``. So a change of basis of every weight upstream of the cut (the embedding, each
block's stream readers and writers up to ``p``) turns the residual ``r`` into ``s r Q`` with no new module, and
the plain checkpoint computes

    y ~ s r Q + z W'

at the cut: ``fold`` is the case ``Q = I, s = 1``. ``s``, ``Q`` and ``W'`` are fitted jointly by alternating
least squares (``W'`` given the rotation, then orthogonal Procrustes for ``(s, Q)`` given ``W'``), every step from
the same streamed float64 moments of ``([r, z], y)``, so the in-sample error is never above ``fold``'s. Several
cuts compose: each cut's change of basis also turns the earlier cuts' ``W'`` and everything before them.

What it costs and where it stops:
- A tied LM head reads the embedding, which the change of basis turns: the head is untied (vocab x hidden more
  parameters, +28.3M on SmolLM2-135M); an untied model pays nothing.
- It is exact but for each norm's epsilon, which sees ``s^2`` times the mean square: a relative change of
  ``eps (1 - 1/s^2) / (2 ms(x))`` in that norm's output, about 1e-7 for a 1e-5 epsilon on a stream of mean
  square 10.
- Block by block (``--offload sequential``) the change of basis is registered against each block's tensors
  and applied wherever they are read next, the export's copy included; the embedding (and a head it unties)
  stay in memory there and are written from it.
- Only RMSNorm blocks whose gain multiplies the normalised stream (the Llama family) can take it: a LayerNorm
  subtracts the mean, which a rotation does not keep, and sandwich norms (Gemma-2/3) normalise the MLP's write
  itself, so neither ``W'`` nor the rotation folds there.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from prune.errors import LayercutError
from prune.loading.offload import current_tensor, rewrite_tensors, streamed
from prune.measure.moments import PairMoments
from prune.model.adapters import arch_spec, get_blocks, get_submodule, hidden_size, input_device
from prune.model.layouts import VANILLA
from prune.replace.capture import PairAccumulator, Recorder, SpanBatch
from prune.replace.fitter import Replacement, SpanFitter, WeightPatch
from prune.replace.fold import check_fold_architecture, check_foldable, mlp_output_projection, uncentred
from prune.replace.options import LeastSquaresOptions, option, whole_number
from prune.replace.registry import Method, register_method

logger = logging.getLogger(__name__)


@dataclass
class RotateOptions(LeastSquaresOptions):
    """``fold-rotate`` takes ``ridge``, ``update_scale`` and ``rotate_iterations``."""

    rotate_iterations: int = option(
        50, help="alternating least-squares rounds of fold-rotate's joint fit of the scale, rotation and MLP write",
        flag="--rotate-iterations", check=lambda v: whole_number(v) and v >= 1, expect="must be a whole number >= 1",
        type=int, neutral=50)  # added after results were recorded: a recipe's digest leaves it out at its default


# ---- the stream's readers and writers ------------------------------------------------------------------


@dataclass
class BlockRoles:
    """What reads and writes the residual stream in one block.

    Attributes:
        readers: each norm of the block and the linear layers that read its output.
        writers: the linear layers whose output is added to the stream (attention's output, the MLP's).
    """

    readers: list[tuple[nn.Module, list[nn.Linear]]]
    writers: list[nn.Linear]


class _Seen(Exception):
    """Ends :func:`stream_roles`' pass once the last block it asks about has run."""


def stream_roles(model: nn.Module, upto: int | None = None) -> list[BlockRoles]:
    """The stream readers and writers of blocks ``0..upto-1`` (every block: None), found by a pass of two tokens.

    A reader is a linear layer fed the very tensor a norm returned; a writer is any other linear layer of the
    block whose output has the stream's width. Raises a one-line error where the block is not of the form
    ``x + W_o f(norm(x) W_in)`` the change of basis needs. The pass stops after block ``upto - 1``: a skeleton
    (``--offload sequential``) reads no block behind the last cut.
    """
    _, blocks = get_blocks(model)
    blocks = list(blocks)[:upto]
    width = hidden_size(model)
    spec = arch_spec(model)
    outputs: dict[int, nn.Module] = {}  # id(tensor a norm returned) -> that norm
    fed: dict[nn.Module, object] = {}  # linear -> the tensor it read
    keep: list[torch.Tensor] = []  # the norms' outputs, alive until the pass ends so that ids stay unique
    handles = []
    for block in blocks:
        for name in spec.norms:
            norm = get_submodule(block, name)

            def after(module, _args, output, keep=keep):
                keep.append(output)
                outputs[id(output)] = module

            handles.append(norm.register_forward_hook(after))
        for module in block.modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(partial(_note_input, fed)))
    def stop(_module, _args, _output):
        raise _Seen

    handles.append(blocks[-1].register_forward_hook(stop))
    try:
        with torch.no_grad(), streamed(model):
            model(input_ids=torch.tensor([[1, 2]], device=input_device(model)), use_cache=False)
    except _Seen:
        pass
    finally:
        for handle in handles:
            handle.remove()
    roles = []
    for index, block in enumerate(blocks):
        norms = [get_submodule(block, name) for name in spec.norms]
        readers = {norm: [] for norm in norms}
        writers = []
        for module in block.modules():
            if not isinstance(module, nn.Linear):
                continue
            source = outputs.get(id(fed.get(module)))
            if source in readers:
                readers[source].append(module)
            elif module.out_features == width:
                writers.append(module)
            elif module.in_features == width and module not in fed:
                raise _unsupported(model, f"block {index}'s {type(module).__name__} reads the stream unseen")
        if any(not linears for linears in readers.values()) or len(writers) != len(norms):
            raise _unsupported(model, f"block {index} is not x + W_out f(norm(x) W_in) per norm")
        roles.append(BlockRoles(list(readers.items()), writers))
    return roles


def _note_input(fed: dict, module: nn.Module, args: tuple) -> None:
    fed.setdefault(module, args[0])


def _unsupported(model: nn.Module, why: str, method: str = "fold-rotate") -> LayercutError:
    return LayercutError(f"--replace {method}: '{model.config.model_type}' {why}; use --replace fold")


def check_rotatable(model: nn.Module, method: str = "fold-rotate") -> None:
    """Fail early, in one line, where no change of basis can carry a rotation (before any calibration pass)."""
    check_fold_architecture(model, method)  # sandwich norms and quantized weights are refused there
    _, blocks = get_blocks(model)
    for name in arch_spec(model).norms:
        _check_gain_norm(model, get_submodule(blocks[0], name), method)


def _check_gain_norm(model: nn.Module, norm: nn.Module, method: str) -> None:
    """The norm must compute ``gain * x / rms(x)``: probed on a wide input, where the epsilon does not count."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise _unsupported(model, f"uses {type(norm).__name__}, not an RMSNorm with a gain (a LayerNorm "
                              "subtracts the mean, which a rotation does not keep)", method)
    if weight.is_meta:  # a model built on the meta device (the planner's): the form is probed on a filled copy
        norm = copy.deepcopy(norm).to_empty(device="cpu")
        with torch.no_grad():
            norm.weight.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
        weight = norm.weight
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)) * 100
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        got = norm(probe).float()
        expected = probe.float() * torch.rsqrt(probe.float().pow(2).mean(-1, keepdim=True)) * weight.float()
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max())):
        raise _unsupported(model, f"uses {type(norm).__name__}, whose output is not gain * x / rms(x), which "
                           "alone commutes with a rotation", method)


# ---- the joint fit ------------------------------------------------------------------------------------


def _factor(g_zz: torch.Tensor, lam: float, eye: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The Cholesky factor of ``g_zz + lam I``, ``lam`` raised tenfold until it exists; the factor and that ``lam``.

    ``z``'s Gram can be rank-deficient where the MLP is as wide as the fitting rows have tokens (Llama-3-8B's 14,336
    inputs on 28 rows of 512 tokens, whose first positions repeat), and rounding then leaves it short of positive
    definite at 1e-10 of its mean diagonal. A larger ridge is the least change that solves it: it stops at the
    first that does, and at a tenth of the mean diagonal gives up in one line.
    """
    mean = float(torch.diagonal(g_zz).mean())
    if not math.isfinite(mean):
        raise LayercutError("--replace fold-rotate: the MLP inputs' Gram is not finite (the calibration pass "
                            "overflowed): use --dtype float32, or --replace fold")
    lam = max(lam, mean * 1e-10, 1e-300)  # a Gram of zeros still gets a ridge to raise
    ceiling = max(mean * 0.1, lam)  # a user's --ridge above it is tried once
    while True:
        factor, info = torch.linalg.cholesky_ex(g_zz + lam * eye)
        if int(info) == 0:
            return factor, lam
        if lam * 10 > ceiling * (1 + 1e-9):
            raise LayercutError(f"--replace fold-rotate: the MLP inputs' Gram is not positive definite even with a "
                                f"ridge of {lam:.3g}: give more calibration rows (--samples), or use --replace fold")
        logger.info("fold-rotate: z's Gram is not positive definite with a ridge of %.3g; trying %.3g", lam,
                    lam * 10)
        lam *= 10


@dataclass
class RotateFit:
    """``y ~ scale * r @ rotation + z @ weight`` (row vectors); ``weight`` is [intermediate, d]."""

    scale: float
    rotation: torch.Tensor
    weight: torch.Tensor
    loss: float
    start_loss: float
    iterations: int


def fit_rotation(moments: PairMoments, dim: int, ridge: float = 0.0, iterations: int = 50) -> RotateFit:
    """Alternating least squares for ``(s, Q, W')`` from the uncentred moments of ``([r, z], y)``.

    ``moments.cxx`` is the Gram of ``[r, z]`` (``r`` its first ``dim`` columns), ``cxy`` its cross-moment with ``y``,
    about the origin (``mean_*`` zero). The first round, from ``Q = I, s = 1``, is ``fold``'s least squares; each
    later one only lowers the error. ``ridge`` is relative to the mean diagonal of ``z``'s Gram, as ``fold``'s.
    """
    gram, cross = moments.cxx.double(), moments.cxy.double()
    g_rr, g_rz, g_zz = gram[:dim, :dim], gram[:dim, dim:], gram[dim:, dim:]
    c_ry, c_zy = cross[:dim], cross[dim:]
    yy = float(torch.trace(moments.cyy.double()))
    tr_rr = float(torch.trace(g_rr))
    eye = torch.eye(g_zz.shape[0], dtype=gram.dtype, device=gram.device)
    lam = ridge * float(torch.diagonal(g_zz).mean()) if ridge > 0 else 1e-10 * float(torch.diagonal(g_zz).mean())
    factor, lam = _factor(g_zz, lam, eye)
    rotation = torch.eye(dim, dtype=gram.dtype, device=gram.device)
    scale = 1.0

    def solved(s: float, q: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``W'`` for ``(s, Q)`` and the loss of ``(s, Q, W')``.

        The loss's two largest products come from the solve itself: with ``a = G_rz^T Q`` and the right-hand side
        ``b = C_zy - s a``, ``(G_zz + lam I) W' = b`` gives ``<W', G_zz W'> = <W', b> - lam <W', W'>`` and
        ``<Q, G_rz W'> = <a, W'>``: no [intermediate, intermediate] product per round.
        """
        a = g_rz.T @ q
        rhs = c_zy - s * g_rz.T @ q  # spelled as it always was ((s G_rz^T) Q): the same weights to the last bit
        w = torch.cholesky_solve(rhs, factor)
        loss = (yy - 2 * s * float(torch.sum(q * c_ry)) - 2 * float(torch.sum(w * c_zy)) + s * s * tr_rr
                + 2 * s * float(torch.sum(a * w)) + float(torch.sum(w * rhs)) - lam * float(torch.sum(w * w)))
        return w, loss

    weight, start = solved(scale, rotation)
    previous = start
    done = 0
    for _ in range(iterations):
        done += 1
        u, sigma, vh = torch.linalg.svd(c_ry - g_rz @ weight)
        rotation = u @ vh
        scale = max(float(sigma.sum()) / tr_rr, 1e-6)
        weight, loss = solved(scale, rotation)
        if previous - loss <= 1e-9 * abs(start):
            previous = loss
            break
        previous = loss
    return RotateFit(scale, rotation, weight, previous, start, done)


def share_of(fit: RotateFit, own: torch.Tensor, share: float) -> RotateFit:
    """``share`` of the way from removal (``s = 1, Q = I, W' = own``) to ``fit``; the rotation kept orthogonal.

    The rotation's share is the orthogonal factor of ``I + share (Q - I)`` (its polar decomposition), which
    turns by about ``share`` of ``Q``'s angles.
    """
    if share == 1:
        return fit
    eye = torch.eye(fit.rotation.shape[0], dtype=fit.rotation.dtype, device=fit.rotation.device)
    u, _, vh = torch.linalg.svd(eye + share * (fit.rotation - eye))
    own = own.to(fit.weight)
    return RotateFit(1 + share * (fit.scale - 1), u @ vh, own + share * (fit.weight - own), fit.loss,
                     fit.start_loss, fit.iterations)


# ---- the change of basis ------------------------------------------------------------------------------


class BasisFold:
    """A fitted cut, put into the weights: ``W'`` into ``p``'s MLP write, ``s Q`` into every weight upstream.

    :meth:`apply` changes the model in place and returns an undo (the driver's patch protocol, as
    :class:`~prune.replace.fitter.WeightPatch`). Cuts apply in block order, each after the earlier ones.
    """

    def __init__(self, model: nn.Module, host: int, fit: RotateFit, roles: Sequence[BlockRoles]):
        self.model, self.host, self.fit, self.roles = model, host, fit, roles
        self.projection = mlp_output_projection(model, get_blocks(model)[1][host])

    def apply(self) -> Callable[[], None]:
        """Write the cut into the weights; the returned function puts the old ones back."""
        model = self.model
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        untied = head is not None and head.weight is embed.weight
        if untied:
            # the head keeps reading the original basis: it gets its own copy before the embedding turns
            head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
            _set_tied(model, False)
            logger.info("fold-rotate unties the LM head from the embedding: +%d parameters",
                        embed.weight.numel())

        undos: list[Callable[[], None]] = []

        def put(module: nn.Module, attr: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
            """``module.attr`` becomes ``change(itself)``, computed in float64 and cast back.

            A skeleton's block holds no weights (``--offload sequential``): the change is what every later
            read of the tensor returns, the export's included (``rewrite_tensors``), as ``fold``'s patch.
            """
            param = getattr(module, attr)

            def changed(old: torch.Tensor) -> torch.Tensor:
                return change(old.detach().double()).to(dtype=old.dtype, device=old.device).contiguous()

            if param.is_meta:
                undos.append(rewrite_tensors([(module, attr, changed)]))
                return
            old = param.data
            param.data = changed(old)
            undos.append(partial(setattr, param, "data", old))

        scale, rotation = self.fit.scale, self.fit.rotation
        weight = self.fit.weight.T  # [d, intermediate]: y = z W'^T, the host's new MLP write
        put(self.projection, "weight", lambda _old: weight)
        mapped = {self.projection}  # p's new write is already in the basis after the cut
        for index, roles in enumerate(self.roles[: self.host + 1]):
            for norm, readers in roles.readers:
                # read now, as earlier cuts left it: the readers take it before the norm's own gain is ones
                gain = current_tensor(norm, "weight").detach().double()
                for reader in readers:
                    # norm(s x Q) = norm(x) Q: a reader of the turned stream reads W_in (g) Q
                    put(reader, "weight", lambda old, gain=gain: (old * gain.to(old.device)) @ rotation.to(old.device))
                put(norm, "weight", torch.ones_like)
            for writer in roles.writers:
                if index == self.host and writer in mapped:
                    continue
                put(writer, "weight", lambda old: scale * rotation.to(old.device).T @ old)
                if writer.bias is not None:
                    put(writer, "bias", lambda old: scale * old @ rotation.to(old.device))
        put(embed, "weight", lambda old: scale * old @ rotation.to(old.device))

        def undo() -> None:
            for step in reversed(undos):
                step()
            if untied:
                head.weight = embed.weight
                _set_tied(model, True)

        return undo

    def hosted(self) -> HostedRotation:
        """The same function with only the host changed: ``s r Q + z W'`` put in by hooks on block ``host``."""
        return HostedRotation(get_blocks(self.model)[1][self.host], self.projection, self.fit)


class HostedRotation:
    """A fitted cut as hooks on its host block: the function :class:`BasisFold` writes into the weights.

    The change of basis turns every weight upstream of the cut, so a pass over the folded model cannot start
    at the cut; a selection measuring many candidate sets (``prune.selection.repaired``) puts this view in
    instead, which changes the host alone: ``W'`` as the MLP write, and the host's output ``r + z W'`` turned
    to ``s r Q + z W'``. The two agree but for each norm's epsilon (see the module's docstring).
    """

    def __init__(self, block: nn.Module, projection: nn.Linear, fit: RotateFit):
        self.block, self.projection, self.fit = block, projection, fit

    def apply(self) -> Callable[[], None]:
        """Hook the host; the returned function takes the hooks and ``W'`` back out."""
        written: dict[str, torch.Tensor] = {}
        weight = self.projection.weight
        device = self.fit.weight.device if weight.is_meta else weight.device  # a skeleton's: read where it runs
        unwrite = WeightPatch(self.projection, self.fit.weight.T.to(dtype=weight.dtype, device=device)
                              .contiguous()).apply()

        def seen(_module, _args, output):
            written["m"] = output

        def turned(_module, _args, output):
            state = output[0] if isinstance(output, tuple) else output
            write = written.pop("m").double()
            rotation = self.fit.rotation.to(state.device)
            new = (self.fit.scale * (state.double() - write) @ rotation + write).to(state.dtype)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handles = [self.projection.register_forward_hook(seen), self.block.register_forward_hook(turned)]

        def undo() -> None:
            for handle in handles:
                handle.remove()
            unwrite()

        return undo


def _set_tied(model: nn.Module, tied: bool) -> None:
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = tied


# ---- the fitter ---------------------------------------------------------------------------------------


class RotateFitter(SpanFitter):
    """Streams the moments of ``([r, z], y)`` at the cut before the span and fits ``(s, Q, W')``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.where = "fold"
        self.projection = mlp_output_projection(self.model, self.original[self.host])
        self.moments = PairAccumulator()
        self.roles = _roles_of(self.model, self.original, self.host + 1)

    def hook_inputs(self, recorder: Recorder) -> None:
        """Also capture the projection's input z and output m."""
        super().hook_inputs(recorder)
        recorder.input_of(self.projection, f"{self.span}.z")
        recorder.output_of(self.projection, f"{self.span}.m")

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate the moments of ([r, z], y), r = h - m."""
        y, h, m, z = (t.reshape(-1, t.shape[-1]) for t in (batch.y, batch.x, batch.m, batch.z))
        self.moments.update(torch.cat([h - m, z], dim=-1), y)

    def finish(self) -> Replacement:
        """The joint fit, a share of it, and the :class:`BasisFold` that writes it into the weights."""
        n = self.moments.n
        options = self.config.options
        fit = fit_rotation(uncentred(self.moments.moments()), self.dim, options.ridge, options.rotate_iterations)
        own = current_tensor(self.projection, "weight").detach().double().T  # a skeleton's: read from its checkpoint
        shared = share_of(fit, own, options.update_scale)
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        unties = head is not None and head.weight is embed.weight
        eye = torch.eye(self.dim, dtype=fit.rotation.dtype, device=fit.rotation.device)
        return Replacement(self.config.method, self.span, "fold", self.host, None,
                           BasisFold(self.model, self.host, shared, self.roles), record={
            "params": 0, "rewrites": arch_spec(self.model).mlp_out, "intercept": False,
            "ridge": options.ridge, "update_scale": options.update_scale, "tokens": n,
            "scale": round(shared.scale, 6), "rotation_angle": round(float(torch.linalg.matrix_norm(
                shared.rotation - eye)) / (2 * self.dim) ** 0.5, 6),
            "fit_loss_vs_fold": round(fit.loss / fit.start_loss, 6) if fit.start_loss > 0 else None,
            "iterations": fit.iterations,
            "unties_head": unties, "head_params_added": embed.weight.numel() if unties else 0})


# model -> (its blocks, the roles of the first ones): one pass serves every span fitted on the same blocks
_ROLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _roles_of(model: nn.Module, blocks: Sequence[nn.Module], upto: int) -> list[BlockRoles]:
    """The roles of ``blocks[:upto]`` (the blocks up to a cut's host: all its change of basis turns)."""
    known = _ROLES.get(model)
    if (known is None or len(known[0]) != len(blocks) or any(a is not b for a, b in zip(known[0], blocks, strict=True))
            or len(known[1]) < upto):
        known = (list(blocks), stream_roles(model, upto))
        _ROLES[model] = known
    return known[1]


def rotate_default(model: nn.Module) -> int:
    """``--replace auto`` ranks fold-rotate above fold where it costs no parameters (an untied head)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is embed.weight:
        return 0
    try:
        check_rotatable(model)
    except LayercutError:
        return 0
    return 2


def untie_cost(model: nn.Module) -> int:
    """Parameters fold-rotate adds to ``model``: its embedding's, where the LM head shares them (a tied head)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return embed.weight.numel() if head is not None and head.weight is embed.weight else 0


def _describe(record: dict) -> str:
    head = f", head untied (+{record['head_params_added']:,} parameters)" if record.get("unties_head") else ""
    return f"scale and rotation as a change of basis upstream, the rest folded into {record['rewrites']}{head}"


register_method(Method(
    "fold-rotate", "the map's scale and rotation as a change of basis upstream of the cut, the rest folded into "
    "the previous block's MLP (plain checkpoint; unties a tied head)", serving=VANILLA, closed_form=True,
    offloadable=True,  # a skeleton's blocks take the change of basis as they are read (rewrite_tensors)
    options=RotateOptions, fitter=RotateFitter, check_model=check_rotatable, check_spans=check_foldable,
    trained_module=lambda model, block, _record: mlp_output_projection(model, block),
    describe=_describe, default_for=rotate_default, adds_params=untie_cost,
    fit_width=lambda hidden, intermediate: hidden + intermediate, fit_rounds=RotateOptions().rotate_iterations,
))
