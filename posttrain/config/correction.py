"""``rl.correction:``: which off-policy correction (``posttrain.corrections.CORRECTIONS``, by name) weights the
policy-gradient term, with its keyword arguments checked at load (each correction's own bounds), and the older
``rl.tis: {mode, cap}`` read as the correction it names (``tis_<mode>`` with that cap)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.config import names
from posttrain.config.base import Refusal, Section, registered

# A band's bounds: the band holds 1 (an on-policy token is never dropped) and lies inside exp(+-20), the clamp of
# every log-ratio (posttrain.algos.LOG_RATIO_CLAMP), so clamping never changes which tokens a band keeps.
MIN_LOW, MAX_HIGH = 1e-6, 1e6


class CapKwargs(Section):
    """``tis_token``, ``tis_sequence``: truncated importance sampling (Yao et al. 2025)."""

    model_config = ConfigDict(strict=True)  # "2" is not 2: the function would get a string
    cap: float = Field(2.0, ge=1, le=MAX_HIGH, description="weights min(ratio, cap)")


class MisKwargs(Section):
    """``mis_token``, ``mis_sequence``: masked IS / rejection (Liu, Li, Yao et al. 2025)."""

    model_config = ConfigDict(strict=True)
    low: float = Field(0.5, ge=MIN_LOW, le=1, description="ratios below are masked (weight 0)")
    high: float = Field(2.0, ge=1, le=MAX_HIGH, description="ratios above are masked (weight 0)")


class IcePopKwargs(Section):
    """``icepop``: IcePop's double-sided token mask (Ling Team 2025, Ring-1T): alpha = low, beta = high."""

    model_config = ConfigDict(strict=True)
    low: float = Field(0.5, ge=MIN_LOW, le=1, description="alpha: ratios below are masked (weight 0)")
    high: float = Field(5.0, ge=1, le=MAX_HIGH, description="beta: ratios above are masked (weight 0)")


# Each correction's keyword arguments, as the function declares them (tests/test_corrections.py compares them with
# the signatures in posttrain.corrections): a misspelt or out-of-bounds kwarg is refused at load.
CORRECTION_KWARGS: dict[str, type[Section]] = {"tis_token": CapKwargs, "tis_sequence": CapKwargs,
                                               "mis_token": MisKwargs, "mis_sequence": MisKwargs,
                                               "icepop": IcePopKwargs}


class CorrectionSpec(Section):
    """One off-policy correction of the policy-gradient term, by name."""

    name: str = Field(description="a key of posttrain.corrections.CORRECTIONS: tis_token, tis_sequence (truncated "
                      "IS), mis_token, mis_sequence (masked IS: tokens, or sequences by their geometric-mean ratio, "
                      "outside [low, high] get weight 0), icepop (token mask outside [low, high], ratio kept inside)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the correction "
                                   "(tis_*: cap; mis_*, icepop: low, high); omitted ones take their defaults")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return registered("correction", v, names.CORRECTIONS)

    @model_validator(mode="after")
    def _kwargs(self) -> CorrectionSpec:
        try:
            CORRECTION_KWARGS[self.name].model_validate(self.kwargs)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            takes = sorted(CORRECTION_KWARGS[self.name].model_fields)
            raise Refusal(f"kwargs.{key}", f"{msg} ({self.name} takes {takes})") from None
        return self


class Tis(Section):
    """The older spelling of a truncated-IS correction: ``rl.tis: {mode, cap}`` is read as
    ``rl.correction: {name: tis_<mode>, kwargs: {cap}}`` (the same weights, bit for bit)."""

    mode: Literal[names.TIS] = Field("token", description="one weight per token, or one per sequence (the "
                                     "product of its ratios)")
    cap: float = Field(2.0, ge=1, le=MAX_HIGH, description="weights min(pi_trainer / pi_sampler, cap)")

    def as_correction(self) -> CorrectionSpec:
        return CorrectionSpec(name=f"tis_{self.mode}", kwargs={"cap": float(self.cap)})


def legacy_tis(data: Any) -> Any:
    """``Rl``'s before-validator: ``rl.tis`` becomes ``rl.correction`` (refused beside one, or when invalid,
    naming ``tis.<key>``)."""
    if not isinstance(data, dict) or "tis" not in data:
        return data
    data = dict(data)
    tis = data.pop("tis")
    if tis is None:
        return data
    if data.get("correction") is not None:
        raise Refusal("tis", "rl.tis is the older spelling of rl.correction: set one of them, not both")
    try:
        spec = tis if isinstance(tis, Tis) else Tis.model_validate(tis)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise Refusal(f"tis.{key}" if key else "tis", msg) from None
    data["correction"] = spec.as_correction()
    return data
