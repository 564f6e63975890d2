"""Moving-average estimators the scheduler's cost model is calibrated with.

The scheduler starts from a latency model (:mod:`conductor.perf.latency`)
and nominal link bandwidths, then corrects both from what it measures:

* :class:`SpeedCalibration` -- per instance, a correction factor over a
  latency model: ``estimate = factor * model``. The factor is an exponentially
  weighted moving average of ``log(measured / modelled)`` (a geometric mean:
  a slow outlier and a fast one of the same ratio cancel out, and one 100x
  stall moves the factor by ``alpha * log(clamp)``, not by 100x). It starts at
  1: before any measurement the estimate is the latency model's.
* :class:`LinkCalibration` -- per directed link (source node, destination
  node), bandwidth as the ratio of two moving averages, of bytes moved and of
  seconds taken: large transfers weigh more, as they should for a throughput.
  Each link starts from a nominal bandwidth, which counts as one earlier
  sample of the size of the first real one, so the first measurements blend
  in instead of replacing it.
* :class:`MeanEstimate` -- a moving average of a plain quantity (the output
  length of requests, for predicting decode load).

Measurements must be positive and finite (InvalidArgument otherwise): a zero
duration is a caller bug, not a very fast instance. Nothing here is
thread-safe: the scheduler that owns the estimators serializes its calls.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

__all__ = ["LinkCalibration", "MeanEstimate", "SpeedCalibration"]


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise InvalidArgument(f"alpha must be in (0, 1], got {alpha}")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            value > 0 and math.isfinite(value)):
        raise InvalidArgument(f"{name} must be a positive finite number, got {value!r}")


class MeanEstimate:
    """Exponentially weighted moving average of one quantity, starting at ``initial``."""

    __slots__ = ("_alpha", "count", "value")

    def __init__(self, initial: float, *, alpha: float = 0.05) -> None:
        _check_alpha(alpha)
        _check_positive("initial", initial)
        self._alpha = alpha
        self.value = float(initial)
        self.count = 0

    def observe(self, sample: float) -> None:
        _check_positive("sample", sample)
        self.value += self._alpha * (sample - self.value)
        self.count += 1


@dataclass(frozen=True, slots=True)
class SpeedFactor:
    """A snapshot of one instance's calibration: ``estimate = factor * model``."""

    factor: float
    samples: int


class SpeedCalibration:
    """Per-instance correction factors over a latency model (see the module docstring).

    ``alpha`` weighs each new sample; ``clamp`` bounds one sample's ratio to
    ``[1/clamp, clamp]``.
    """

    def __init__(self, *, alpha: float = 0.2, clamp: float = 20.0) -> None:
        _check_alpha(alpha)
        if not clamp > 1.0:
            raise InvalidArgument(f"clamp must be > 1, got {clamp}")
        self._alpha = alpha
        self._log_clamp = math.log(clamp)
        self._log_factor: dict[Hashable, float] = {}
        self._samples: dict[Hashable, int] = {}

    def factor(self, instance: Hashable) -> float:
        """The current factor of ``instance`` (1.0 before its first measurement)."""
        log_factor = self._log_factor.get(instance)
        return 1.0 if log_factor is None else math.exp(log_factor)

    def snapshot(self, instance: Hashable) -> SpeedFactor:
        return SpeedFactor(self.factor(instance), self._samples.get(instance, 0))

    def observe(self, instance: Hashable, measured_s: float, modelled_s: float) -> float:
        """Fold one measurement in; return the new factor."""
        _check_positive("measured_s", measured_s)
        _check_positive("modelled_s", modelled_s)
        ratio = math.log(measured_s / modelled_s)
        ratio = max(-self._log_clamp, min(self._log_clamp, ratio))
        prev = self._log_factor.get(instance, 0.0)
        new = prev + self._alpha * (ratio - prev)
        self._log_factor[instance] = new
        self._samples[instance] = self._samples.get(instance, 0) + 1
        return math.exp(new)

    def forget(self, instance: Hashable) -> None:
        """Drop an instance's history (it left, or was replaced by a different machine)."""
        self._log_factor.pop(instance, None)
        self._samples.pop(instance, None)


class LinkCalibration:
    """Per directed link bandwidth, from moving averages of bytes and seconds.

    ``nominal_bytes_per_s`` is what an unmeasured link is assumed to carry.
    """

    def __init__(self, nominal_bytes_per_s: float, *, alpha: float = 0.2) -> None:
        _check_positive("nominal_bytes_per_s", nominal_bytes_per_s)
        _check_alpha(alpha)
        self._nominal = float(nominal_bytes_per_s)
        self._alpha = alpha
        # Per link: (moving average of bytes per transfer, of seconds per transfer, samples).
        self._links: dict[tuple[str, str], list[float]] = {}

    @property
    def nominal_bytes_per_s(self) -> float:
        return self._nominal

    def bandwidth_bytes_per_s(self, src: str, dst: str) -> float:
        link = self._links.get((src, dst))
        return self._nominal if link is None else link[0] / link[1]

    def transfer_s(self, src: str, dst: str, size_bytes: int) -> float:
        """Estimated seconds to move ``size_bytes`` from ``src`` to ``dst`` (0 for 0 bytes)."""
        if size_bytes <= 0:
            return 0.0
        return size_bytes / self.bandwidth_bytes_per_s(src, dst)

    def samples(self, src: str, dst: str) -> int:
        link = self._links.get((src, dst))
        return 0 if link is None else int(link[2])

    def observe(self, src: str, dst: str, size_bytes: int, seconds: float) -> float:
        """Fold one completed transfer in; return the link's new bandwidth estimate."""
        _check_positive("size_bytes", size_bytes)
        _check_positive("seconds", seconds)
        link = self._links.get((src, dst))
        if link is None:
            # The nominal bandwidth as one earlier sample of the same size.
            link = [float(size_bytes), size_bytes / self._nominal, 0.0]
            self._links[(src, dst)] = link
        a = self._alpha
        link[0] += a * (size_bytes - link[0])
        link[1] += a * (seconds - link[1])
        link[2] += 1
        return link[0] / link[1]

    def forget_node(self, node_id: str) -> None:
        """Drop the history of every link from or to ``node_id``."""
        for link in [k for k in self._links if node_id in k]:
            del self._links[link]
