"""
The kernel engine's method under ``method="auto"``, chosen by counted work: not timed and not by the device's type,
so that the same call always runs the same method whatever else the machine is doing (neural-tangents' ``AUTO``
picks among its implementations by FLOPs in the same spirit).

For each method the engine counts, on one probe sub-batch (:func:`count`): the floating-point operations of its
per-example factors (``torch.utils.flop_counter``: the forward pass, the class-batched reverse pass, the factors'
formation), the numbers its operators write (memory traffic, :data:`NUMBER_SECONDS` each), the operator calls it
dispatches (each costs a fixed overhead, :data:`CALL_SECONDS`), its host synchronisations (:data:`SYNC_SECONDS`),
and from the factors' shapes the operations of the contraction per pair of examples. The estimated time of a kernel
of ``n1 × n2`` examples (:meth:`MethodCost.seconds`) is

    examples · (factor operations / (rate · FACTOR_SHARE) + numbers written · NUMBER_SECONDS)
    + sub-batches · (calls · CALL_SECONDS + syncs · SYNC_SECONDS + random numbers · RANDOM_SECONDS)
    + pairs · pair operations / (rate · CONTRACTION_SHARE)

at the device's nominal float64 rate (:func:`~art_malleability._utils.machine.nominal_gemm_rate`), and ``"auto"``
runs the method with the least. The methods differ where they store different factors: ``"structured"`` compresses
the blocks whose output gradients are rank one over the classes on the probe (``C`` times fewer contraction
operations there) at the price of one host read per sub-batch; ``"batched"`` reads nothing back; ``"jacobian"`` forms
every per-example gradient and contracts them whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from art_malleability._utils.machine import nominal_gemm_rate

#: The constants below are fixed facts by device type, fitted on the CPU (2 threads, float64) to the class-batched
#: passes of eight architectures (ResNet-18, MobileNetV3-small, ShuffleNetV2, DenseNet-121, a small
#: VisionTransformer, and the package's SmallCNN, ResNet-20 and 2L-ReLU) at 1 and 8 examples a pass: the fitted
#: times lie within 0.43-1.27 of the measured ones (the low end: MobileNet's depthwise convolutions, which float64
#: runs group by group). GPU values are nominal.
#: Seconds of one dispatched operator's fixed overhead (the dispatcher, ``torch.func``'s wrapping, a launch).
CALL_SECONDS = {"cpu": 1.8e-5, "cuda": 2.0e-5}
#: Seconds per number an operator writes (memory traffic of elementwise work the operation count leaves out).
NUMBER_SECONDS = {"cpu": 1.0e-9, "cuda": 1.0e-11}
#: Seconds per Gaussian number drawn from a seeded generator (the projection's matrices: the CPU draws them one by one,
#: 22 ns each measured in float64; GPU nominal).
RANDOM_SECONDS = {"cpu": 2.2e-8, "cuda": 1.0e-11}
#: Seconds of one host synchronisation (the CPU has none to wait for).
SYNC_SECONDS = {"cpu": 0.0, "cuda": 5.0e-5}
#: Share of the nominal rate at which the factors' counted operations run (fitted: 0.33 of a nominal 128 GFLOP/s), and
#: at which the contraction's large matrix products run.
FACTOR_SHARE = 0.33
CONTRACTION_SHARE = 0.6
#: Operation-equivalents of one operation of a convolution with at most :data:`THIN_GROUP_CHANNELS` input channels per
#: group (depthwise ones, and those ``vmap`` batches into more groups): the CPU runs them group by group, measured at
#: 0.1-8 GFLOP/s on 2 cores in float32 and float64 (MobileNetV3-small's depthwise layers, forward and backward), against
#: about 40 for the other counted operations.
THIN_GROUP_WEIGHT = 16
THIN_GROUP_CHANNELS = 8


@dataclass(frozen=True)
class MethodCost:
    """
    A method's counted work.

    :param method: The method.
    :param example_flops: Operations of one example's factors.
    :param example_writes: Numbers the operators write for one example's factors.
    :param pair_flops: Operations of the contraction per pair of examples.
    :param calls: Operators dispatched per sub-batch.
    :param syncs: Host synchronisations per sub-batch.
    :param example_numbers: Numbers stored per example (the factors kept for the contraction).
    :param bits: Bits of the dtype the work runs in (the nominal rate is float64's; float32 runs twice as many
        operations per cycle).
    :param random: Random numbers drawn per sub-batch (a projection's Gaussian blocks drawn again in every pass).
    """

    method: str
    example_flops: float
    example_writes: float
    pair_flops: float
    calls: float
    syncs: float
    example_numbers: int
    bits: int = 64
    random: float = 0.0

    def seconds(self, examples: float, pairs: float, sub_batches: float, device: torch.device) -> float:
        """Estimated seconds of a kernel that computes ``examples`` examples' factors in ``sub_batches`` passes and
        contracts ``pairs`` pairs, at the device's nominal rate and fixed overheads."""
        rate, _ = nominal_gemm_rate(device)
        rate *= max(1.0, 64.0 / self.bits)
        kind = device.type if device.type in CALL_SECONDS else "cpu"
        return (examples * (self.example_flops / (rate * FACTOR_SHARE) + self.example_writes * NUMBER_SECONDS[kind])
                + sub_batches * (self.calls * CALL_SECONDS[kind] + self.syncs * SYNC_SECONDS[kind]
                                 + self.random * RANDOM_SECONDS[kind])
                + pairs * self.pair_flops / (rate * CONTRACTION_SHARE))

    def example_seconds(self, rows: int, device: torch.device) -> float:
        """Estimated seconds of one example's factors in passes of ``rows`` examples (its share of a pass's calls)."""
        return self.seconds(1.0, 0.0, 1.0 / max(rows, 1), device)

    def to_dict(self) -> dict:
        return asdict(self)


_CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward}


def _weight(func: object, args: tuple) -> int:
    """Operation-equivalents of one counted operation of ``func`` (:data:`THIN_GROUP_WEIGHT` for a convolution with
    thin groups, else one)."""
    if func.overloadpacket not in _CONVOLUTIONS:
        return 1
    weight = args[2] if func.overloadpacket is torch.ops.aten.convolution_backward else args[1]
    thin = isinstance(weight, torch.Tensor) and weight.dim() > 2 and weight.shape[1] <= THIN_GROUP_CHANNELS
    return THIN_GROUP_WEIGHT if thin else 1


class OpCounter(TorchDispatchMode):
    """
    Counts what the operators dispatched inside it do: the calls, the numbers they write (outputs that are not views)
    and their floating-point operations (``torch.utils.flop_counter``'s formulas, without its module tracking). One
    Python dispatch mode for the three, so that counting a probe costs little more than running it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.writes = 0
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls += 1
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.writes += t.numel()
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out)) * _weight(func, args)
        return out


def count(compute: object, *args: object) -> tuple[object, float, float, int]:
    """
    Run ``compute(*args)`` counting its floating-point operations, the numbers its operators write and the operators
    it dispatches (:class:`OpCounter`).

    :return: Its result, the operations, the numbers written and the operator calls.
    """
    with OpCounter() as counter:
        out = compute(*args)
    return out, float(counter.flops), float(counter.writes), counter.calls


@dataclass
class MethodChoice:
    """
    What ``method="auto"`` chose and why.

    :param method: The method that runs.
    :param reason: In words.
    :param costs: Each candidate's counted work.
    :param seconds: Each candidate's estimated seconds for the computation it was chosen for.
    """

    method: str
    reason: str
    costs: dict[str, MethodCost]
    seconds: dict[str, float]

    def to_dict(self) -> dict:
        return {"method": self.method, "reason": self.reason, "seconds": dict(self.seconds),
                "costs": {m: c.to_dict() for m, c in self.costs.items()}}


def choose(costs: dict[str, MethodCost], examples: dict[str, float], pairs: float, sub_batches: dict[str, float],
           device: torch.device) -> MethodChoice:
    """
    The method with the least estimated time (ties: the first given).

    :param costs: The candidates' counted work, in order of preference on a tie.
    :param examples: Examples whose factors each method computes (recomputations included).
    :param pairs: Pairs of examples contracted.
    :param sub_batches: Passes each method runs.
    :param device: The compute device.
    :return: The choice.
    """
    seconds = {m: c.seconds(examples[m], pairs, sub_batches[m], device) for m, c in costs.items()}
    best = min(seconds, key=lambda m: seconds[m])
    others = ", ".join(f"{m} {s:.3g} s" for m, s in seconds.items() if m != best)
    c = costs[best]
    reason = (f"{best}: the least counted work for {int(examples[best])} examples' factors and {int(pairs)} pairs "
              f"(estimated {seconds[best]:.3g} s: {c.example_flops / 1e6:.3g} MFLOP an example, "
              f"{c.pair_flops / 1e3:.3g} kFLOP a pair, {c.calls:.0f} operator calls a pass; {others})")
    return MethodChoice(best, reason, costs, seconds)


def loss_step_cost(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> MethodCost:
    """
    The counted work of one forward and backward pass of a batch's loss with the gradients of the inputs and every
    trained weight (an attack's step, one per-example gradient of TracIn), per example.

    :param model: The model.
    :param x: A few inputs, in the model's dtype and device.
    :param y: Their labels.
    :param loss: ``(outputs, labels) -> scalar``.
    :return: The cost (its ``calls`` are one batch's).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    x = x.detach().requires_grad_(True)

    def step() -> None:
        with torch.enable_grad():
            torch.autograd.grad(loss(model(x), y), [x, *params], allow_unused=True)

    _, flops, writes, calls = count(step)
    n = x.shape[0]
    numel = sum(p.numel() for p in params)
    return MethodCost("step", flops / n, writes / n, 0.0, float(calls), 0.0, numel, torch.finfo(x.dtype).bits)
