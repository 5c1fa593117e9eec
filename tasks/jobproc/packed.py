"""The packed trainer: K trials of one job, same shapes, trained as one vmapped model.

Each member's model is built from its own seed (``torch.manual_seed(seed)`` then the job's
:attr:`Packing.model <tasks.core.job.Packing>`), the K models are stacked
(``torch.func.stack_module_state``) and one step runs every member's batch at once
(``torch.vmap`` over ``torch.func.functional_call``). The optimizer is Adam on the stacked
tensors, with each member's lr and weight decay: torch.optim.Adam's math (L2 weight decay added
to the gradient, bias-corrected moments, ``eps`` outside the square root), so a packed trial
ends where the same trial trained alone does, within float rounding. Each member draws its
batches in the order ``train``'s DataLoader would (:class:`~tasks.core.batch_order.LoaderOrder`). The data stays on the
device; the losses and hit counts of every member are read back once per epoch.

A member whose loss is not finite, or whose ``ctx.progress()`` raises (cancelled, pruned,
preempted, out of time), is masked out: its updates are zeroed from then on and it ends at once
(``on_end``) while the others go on. Each member has its own Adam step count and epoch count,
so a freed place (a member that ended, early or done) can take a new trial mid-pack
(``refill``): its weights from its seed, its moments zero, its steps 0, its own epochs.

A member saves what its job's own function resumes from (:attr:`Packing.checkpoint
<tasks.core.job.Packing>`: ``train``'s ``resume.safetensors``) when its ``checkpoint_every_s``
has passed or it is asked to make way, so a member that runs again unpacked resumes. Not here
yet: resuming inside a pack (a packed member starts from its first epoch).
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from ..core.batch_order import LoaderOrder
from ..core.errors import InvalidJobArguments, TrainingDiverged
from ..core.job import JobContext, PackData, Packing
from .oom import warm_cublas

#: Adam's constants, as torch.optim.Adam's defaults.
BETAS = (0.9, 0.999)
EPS = 1e-8
#: Test samples scored per vmapped step.
EVAL_CHUNK = 4096

#: ``on_end(index, output, error)``: the member in place ``index`` ended early (its error), or
#: finished while the pack goes on (its output).
OnEnd = Callable[[int, dict[str, Any] | None, BaseException | None], None]


@dataclass
class Member:
    """One trial of a pack: its context, its validated params and its data (CPU tensors)."""

    ctx: JobContext
    params: Any
    data: PackData
    history: list[dict[str, float]] = field(default_factory=list)
    #: When its last checkpoint was saved (``time.monotonic()``).
    saved_at: float = field(default_factory=time.monotonic)
    #: How its pack's size was chosen (``pack="auto"``), for its output; None: asked as ``pack=K``.
    chosen: str | None = None


#: ``refill(index) -> Member | None``: the next trial to take the free place ``index`` (None: no more).
Refill = Callable[[int], "Member | None"]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors, by name (as ``train``'s ``weights_digest`` of a model)."""
    hashed = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        hashed.update(name.encode())
        hashed.update(value.detach().cpu().contiguous().numpy().tobytes())
    return hashed.hexdigest()


def bytes_per_member(packing: Packing, params: Any, data: PackData) -> int:
    """An estimate of the device memory one member of a pack needs: its weights, gradients and
    two Adam moments, its data, and a batch's activations (counted on one sample of a throwaway
    model, under autograd, with margin for the backward pass)."""
    torch.manual_seed(0)
    model = packing.model(params, data)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tensors = [data.x_train, data.y_train, data.x_test, data.y_test]
    resident = sum(int(t.numel() * t.element_size()) for t in tensors)
    activations = 0

    def count(_module: Any, _inputs: Any, output: Any) -> None:
        nonlocal activations
        if isinstance(output, torch.Tensor):
            activations += output.numel() * output.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    try:
        with torch.no_grad():
            model(data.x_train[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return 4 * weights + resident + 3 * activations * int(params.batch_size)


def probe_bytes(packing: Packing, params: Any, data: PackData, torch_device: str) -> tuple[int, str]:
    """The device memory one member needs, and how it was found: on a CUDA device ``measured``
    by a short probe (its data resident, one Adam step of one batch, the allocator's peak over
    what was allocated before); elsewhere (no allocator to ask) ``estimated``
    (:func:`bytes_per_member`)."""
    if not torch_device.startswith("cuda"):
        return bytes_per_member(packing, params, data), "estimated"
    device = torch.device(torch_device)
    warm_cublas(torch_device)  # cuBLAS's workspaces are the process's, not a member's: in ``before``
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(int(params.seed))
    net = packing.model(params, data).to(device)
    tensors = [t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test)]
    optimizer = torch.optim.Adam(net.parameters(), lr=float(params.lr))
    batch = int(params.batch_size)
    loss = (packing.loss or torch.nn.functional.cross_entropy)(net(tensors[0][:batch]), tensors[1][:batch])
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del net, tensors, optimizer, loss
    return max(1, int(peak)), "measured"


def choose_pack(wanted: int, per_member: int, budget: int | None, cap: int) -> tuple[int, str]:
    """How many of ``wanted`` trials one pack trains: ``min(budget // per_member, cap, wanted)``
    (no budget: ``min(cap, wanted)``), and why, in words. 0 when not one member fits."""
    if budget is None:
        k = min(cap, wanted)
        return k, f"{k} of {wanted} trials: no memory budget on this slot (at most {cap})"
    fit = budget // max(1, per_member)
    k = min(fit, cap, wanted)
    limits = f"the slot's budget of {budget / 1024**2:.0f} MiB fits {fit} at about {per_member / 1024**2:.1f} MiB each"
    if k == 0:
        return 0, f"not one trial fits: {limits}"
    return k, f"{k} of {wanted} trials: {limits} (at most {cap})"


def train_pack(packing: Packing, members: list[Member], torch_device: str, on_end: OnEnd,
               refill: Refill | None = None) -> dict[int, dict[str, Any]]:
    """Train ``members`` as one packed model on ``torch_device``; call ``on_end`` for each
    member that ends early (diverged, stopped) as it ends; return the outputs of those that
    trained to the end, by index, once the pack's tensors are unreachable (so what the process
    then holds is what it will hold). Raises only what fails the whole pack (running out of
    memory, a model that does not build).

    With ``refill``, a place freed by a member that ended (early or done) is offered to
    ``refill(index)`` at the end of the pack's epoch: a new :class:`Member` takes the place (its
    weights built from its seed, its Adam moments zero, its step count 0, its own epochs) and
    the member that finished is ended at once through ``on_end(index, output, None)``; the
    pack ends when no place is alive and ``refill`` gave no more (after its first ``None`` it is
    not asked again). Every member has its own step count and epoch count, so a member that
    joined later trains exactly as it would alone."""
    from torch.func import functional_call, stack_module_state

    device = torch.device(torch_device)
    members = list(members)
    first = members[0].params
    epochs, batch_size = int(first.epochs), int(first.batch_size)
    models = []
    for member in members:
        torch.manual_seed(member.params.seed)
        models.append(packing.model(member.params, member.data).to(device))
    stacked, buffers = stack_module_state(models)  # type: ignore[arg-type]
    base = copy.deepcopy(models[0]).to("meta")
    del models
    names = list(stacked)
    weights = [stacked[name].detach().requires_grad_(True) for name in names]
    moments = [torch.zeros_like(w) for w in weights]
    squares = [torch.zeros_like(w) for w in weights]
    k = len(members)
    lr = torch.tensor([float(m.params.lr) for m in members], device=device)
    decay = torch.tensor([float(getattr(m.params, "weight_decay", 0.0)) for m in members], device=device)
    # Each member's own Adam step count (its bias correction) and epoch count: a place refilled
    # mid-pack starts both at 0 while the others go on.
    steps = torch.zeros(k, dtype=torch.float64, device=device)
    epoch_of = [0] * k
    started_at = [time.perf_counter()] * k
    refilled = [False] * k
    active = torch.ones(k, dtype=torch.bool, device=device)
    alive = [True] * k
    x = torch.stack([m.data.x_train for m in members]).to(device)
    y = torch.stack([m.data.y_train for m in members]).to(device)
    samples = int(y.shape[1])
    rows = torch.arange(k, device=device)[:, None]
    orders = [LoaderOrder(int(m.params.seed), samples) for m in members]
    loss_of = packing.loss or torch.nn.functional.cross_entropy

    def one(w: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xb: torch.Tensor,
            yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = functional_call(base, (w, b), (xb,))
        return loss_of(out, yb), out

    step_all = torch.vmap(one)

    def stop(index: int, error: BaseException | None, output: dict[str, Any] | None = None) -> None:
        alive[index] = False
        active[index] = False
        on_end(index, output, error)

    def seat(index: int, member: Member) -> None:
        """Member ``member`` takes place ``index``: as it would start alone."""
        torch.manual_seed(member.params.seed)
        net = packing.model(member.params, member.data).to(device)
        fresh = dict(net.named_parameters())
        fresh_buffers = dict(net.named_buffers())
        with torch.no_grad():
            for name, w, m, v in zip(names, weights, moments, squares, strict=True):
                w[index].copy_(fresh[name])
                m[index].zero_()
                v[index].zero_()
            for name, b in buffers.items():
                b[index].copy_(fresh_buffers[name])
            x[index].copy_(member.data.x_train)
            y[index].copy_(member.data.y_train)
        lr[index] = float(member.params.lr)
        decay[index] = float(getattr(member.params, "weight_decay", 0.0))
        steps[index] = 0
        epoch_of[index] = 0
        started_at[index] = time.perf_counter()
        refilled[index] = True
        orders[index] = LoaderOrder(int(member.params.seed), samples)
        members[index] = member
        alive[index] = True
        active[index] = True

    def refill_free() -> None:
        """Offer each free place to ``refill`` until it gives no more."""
        nonlocal refill
        for index in range(k):
            while refill is not None and not alive[index]:
                if index in finished:  # the place's last member ends before a newcomer answers for it
                    on_end(index, finished.pop(index), None)
                member = refill(index)
                if member is None:
                    refill = None
                    return
                mismatch = _mismatch(packing, members[index], member, epochs, batch_size)
                if mismatch is not None:
                    on_end(index, None, mismatch)  # the newcomer ends alone; the place stays free
                    continue
                seat(index, member)

    finished: dict[int, dict[str, Any]] = {}
    while any(alive):
        round_started = time.perf_counter()
        order = torch.stack([o.next_epoch() for o in orders]).to(device)
        loss_sum = torch.zeros(k, device=device)
        correct = torch.zeros(k, dtype=torch.long, device=device)
        for start in range(0, samples, batch_size):
            index = order[:, start : start + batch_size]
            xb, yb = x[rows, index], y[rows, index]
            losses, logits = step_all(dict(zip(names, weights, strict=True)), buffers, xb, yb)
            grads = torch.autograd.grad(torch.where(active, losses, 0.0).sum(), weights)
            steps.add_(active.to(steps.dtype))
            _adam(weights, grads, moments, squares, lr, decay, active, steps)
            loss_sum += losses.detach() * yb.shape[1]
            correct += (logits.detach().argmax(dim=-1) == yb).sum(dim=1)
        sums = torch.stack([loss_sum.double(), correct.double()]).cpu().tolist()  # one read per epoch
        epoch_s = time.perf_counter() - round_started  # after that read: the epoch's kernels are done
        for i, member in enumerate(members):
            if not alive[i]:
                continue
            epoch_of[i] += 1
            epoch = epoch_of[i]
            loss, accuracy = sums[0][i] / samples, sums[1][i] / samples
            if not math.isfinite(loss):
                stop(i, TrainingDiverged(f"loss became {loss} at epoch {epoch} (lr={member.params.lr}); "
                                         "lower the learning rate or check the dataset"))
                continue
            member.history.append({"epoch": epoch, "loss": loss, "accuracy": accuracy})
            member.ctx.log(epoch, **{"loss/train": loss, "accuracy/train": accuracy,
                                     "samples_per_s": samples / epoch_s if epoch_s > 0 else 0.0,
                                     "data_wait_fraction": 0.0})
            # Saved before the report, as train saves: a preempted member's progress() raises.
            every = getattr(member.params, "checkpoint_every_s", None)
            due = every is not None and time.monotonic() - member.saved_at >= every
            if packing.checkpoint is not None and epoch < epochs and (due or member.ctx.preempted()):
                net, optimizer = _unstacked(packing, member, names, weights, moments, squares, buffers, i,
                                            int(steps[i].item()))
                packing.checkpoint(member.ctx, member.params, net, optimizer, epoch)
                member.saved_at = time.monotonic()
            try:
                member.ctx.progress(epoch=epoch, epochs=epochs, loss=round(loss, 6))
            except Exception as exc:  # cancelled, pruned, preempted, out of time: this member only
                stop(i, exc)
        done = [i for i in range(k) if alive[i] and epoch_of[i] >= epochs]
        if done:
            accuracies = _evaluate(step_all, names, weights, buffers, members, alive, device)
            for i in done:
                state = {name: w[i].detach() for name, w in zip(names, weights, strict=True)}
                state.update({name: b[i] for name, b in buffers.items()})
                finished[i] = _output(packing, members[i], state, accuracies[i],
                                      time.perf_counter() - started_at[i], k, i, refilled[i])
                alive[i] = False
                active[i] = False
        refill_free()
        if any(alive):  # the pack goes on: those that finished end now, not when it ends
            for i in list(finished):
                output = finished.pop(i)
                on_end(i, output, None)
    return finished


def _mismatch(packing: Packing, place: Member, newcomer: Member, epochs: int, batch_size: int) -> BaseException | None:
    """Why ``newcomer`` cannot take ``place``'s seat (None: it can): its pack key or its data's shapes."""
    if packing.key_of(newcomer.params) != packing.key_of(place.params) or int(newcomer.params.epochs) != epochs \
            or int(newcomer.params.batch_size) != batch_size:
        return InvalidJobArguments(f"a trial whose {', '.join(packing.key)} differ from its pack's cannot take a "
                                   "place in it; it runs in a pack of its own shape")
    for name in ("x_train", "y_train", "x_test", "y_test"):
        ours, theirs = getattr(place.data, name), getattr(newcomer.data, name)
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return InvalidJobArguments(f"a trial whose data {name} is {tuple(theirs.shape)} {theirs.dtype} cannot take "
                                       f"a place in a pack whose {name} is {tuple(ours.shape)} {ours.dtype}")
    return None


def _adam(weights: list[torch.Tensor], grads: tuple[torch.Tensor, ...], moments: list[torch.Tensor],
          squares: list[torch.Tensor], lr: torch.Tensor, decay: torch.Tensor, active: torch.Tensor,
          steps: torch.Tensor) -> None:
    """One step of torch.optim.Adam (amsgrad off) on stacked tensors, per member's lr, weight
    decay and step count (``steps``, float64, already counting this step); a masked-out member
    keeps its weights and moments."""
    beta1, beta2 = BETAS
    counted = steps.clamp(min=1)  # a masked place that never stepped: its (discarded) update stays finite
    # The bias corrections in float64, as torch.optim.Adam computes them in Python floats.
    step_size = (lr.double() / (1 - beta1**counted)).to(lr.dtype)
    correction2_sqrt = (1 - beta2**counted).sqrt().to(lr.dtype)
    with torch.no_grad():
        for w, g, m, v in zip(weights, grads, moments, squares, strict=True):
            shape = (-1,) + (1,) * (w.dim() - 1)
            on = active.view(shape)
            g = g + decay.view(shape) * w
            m.copy_(torch.where(on, m.lerp(g, 1 - beta1), m))
            v.copy_(torch.where(on, v * beta2 + (1 - beta2) * g * g, v))
            denom = v.sqrt() / correction2_sqrt.view(shape) + EPS
            w.sub_(torch.where(on, step_size.view(shape) * m / denom, 0.0))


def _unstacked(packing: Packing, member: Member, names: list[str], weights: list[torch.Tensor],
               moments: list[torch.Tensor], squares: list[torch.Tensor], buffers: dict[str, torch.Tensor],
               index: int, step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Member ``index`` as the model and ``torch.optim.Adam`` it would have trained alone: its
    weights, and its moments after ``step`` steps."""
    net = packing.model(member.params, member.data).to(weights[0].device)
    with torch.no_grad():
        state = {name: w[index] for name, w in zip(names, weights, strict=True)}
        state.update({name: b[index] for name, b in buffers.items()})
        net.load_state_dict(state)
    optimizer = torch.optim.Adam(net.parameters(), lr=float(member.params.lr),
                                 weight_decay=float(getattr(member.params, "weight_decay", 0.0)))
    named = dict(net.named_parameters())
    for name, m, v in zip(names, moments, squares, strict=True):
        optimizer.state[named[name]] = {"step": torch.tensor(float(step)), "exp_avg": m[index].clone(),
                                        "exp_avg_sq": v[index].clone()}
    return net, optimizer


def _evaluate(step_all: Any, names: list[str], weights: list[torch.Tensor], buffers: dict[str, torch.Tensor],
              members: list[Member], alive: list[bool], device: torch.device) -> list[float]:
    """Each member's accuracy on its own test split (one read for all)."""
    x = torch.stack([m.data.x_test for m in members]).to(device)
    y = torch.stack([m.data.y_test for m in members]).to(device)
    hits = torch.zeros(len(members), dtype=torch.long, device=device)
    with torch.no_grad():
        w = {name: t.detach() for name, t in zip(names, weights, strict=True)}
        for start in range(0, int(y.shape[1]), EVAL_CHUNK):
            yb = y[:, start : start + EVAL_CHUNK]
            _, logits = step_all(w, buffers, x[:, start : start + EVAL_CHUNK], yb)
            hits += (logits.argmax(dim=-1) == yb).sum(dim=1)
    tested = int(y.shape[1])
    return [hit / tested for hit in hits.cpu().tolist()]


def _output(packing: Packing, member: Member, state: dict[str, torch.Tensor], accuracy: float,
            train_s: float, k: int, index: int, refilled: bool = False) -> dict[str, Any]:
    """A member's result: the fields ``train`` gives, its checkpoint, and where it sat in the pack."""
    ctx, params = member.ctx, member.params
    ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = ctx.artifacts_dir / f"{ctx.device}-packed.safetensors"
    cpu_state = {name: t.cpu().contiguous() for name, t in state.items()}
    save_file(cpu_state, str(checkpoint), metadata={"epochs": str(params.epochs), "packed": str(k)})
    ctx.log(int(params.epochs), **{"accuracy/test": accuracy})
    samples_seen = int(member.data.y_train.shape[0]) * int(params.epochs)
    return {
        "accuracy": accuracy,
        "loss": member.history[-1]["loss"],
        "samples_per_s": samples_seen / train_s if train_s > 0 else None,
        # The data is resident on the device: no step waits for it.
        "data_wait_fraction": 0.0,
        **(packing.output(params, member.data) if packing.output is not None else {}),
        "epochs": params.epochs,
        "samples_seen": samples_seen,
        "resumed_from_epoch": 0,
        "train_s": train_s,
        "checkpoint": str(checkpoint),
        "weights_digest": digest(cpu_state),
        "history": member.history,
        # The pack's process; a member that took a freed place says so.
        "packed": {"members": k, "index": index, "pid": os.getpid(), **({"refilled": True} if refilled else {}),
                   **({"chosen": member.chosen} if member.chosen is not None else {})},
    }
