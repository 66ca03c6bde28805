"""Whether this CPU multiplies bfloat16 matrices natively: what DTYPE means when it is not set.

``has_native_bf16()`` reads the CPU's feature flags (Linux: ``/proc/cpuinfo``):

* x86-64: ``avx512_bf16`` (AMD Zen 4 and later, Intel Cooper Lake) or ``amx_bf16`` (Intel Sapphire Rapids
  and later);
* aarch64: ``bf16`` in the ``Features`` line (Armv8.6 BFloat16: AWS Graviton 3 and later, Neoverse V1/N2).

Without them torch's CPU kernels convert bfloat16 to float32 and back around every product, which costs
more than the halved weight traffic saves: on a 2-core AMD EPYC without AVX512-BF16 (flags avx avx2), the
embedded SmolLM2-135M prefilled 40 tokens in 615 ms in bfloat16 against 166 ms in float32, and a batch-8
decode step took 137 ms against 93 ms. So DTYPE unset is bfloat16 where the flags are present and float32
elsewhere (``llm_api.model.loader.resolve_dtype``).

``cpu_model_name()`` reads the model name (a key of the cached step budget), ``cpu_vendor()`` the vendor
(``llm_api.model.packed_linear.weight_layout`` splits float32 products across the cores on AMD CPUs, where
torch's float32 products, MKL's, run a one-row product on one core).

The rule reads flags rather than timing a product at start-up (what it did before): a timing on a busy
machine can land either side of any threshold, and then the same host serves in one precision on one
start and in the other on the next, with different answers at near-ties. A flag read gives every start
on one host the same precision. Where no ``/proc/cpuinfo`` exists (macOS, Windows) the answer is False:
float32, the precision every CPU computes at full speed (set DTYPE=bfloat16 to choose otherwise).
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
ARM_BF16_FEATURE = "bf16"


def _first_field(cpuinfo: str, names: tuple[str, ...]) -> str:
    """The value of the first ``name : value`` line of a ``/proc/cpuinfo`` text whose name is one of
    ``names`` ("" when none is): the first processor's, and every core of a machine reports the same."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in names:
            return value.strip()
    return ""


def _this_cpuinfo() -> str:
    """This machine's ``/proc/cpuinfo`` text ("" where there is none)."""
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return ""


def cpu_features(cpuinfo: str) -> frozenset[str]:
    """The feature words of the first processor in a ``/proc/cpuinfo`` text (x86 ``flags``, arm
    ``Features``)."""
    return frozenset(_first_field(cpuinfo, ("flags", "Features")).split())


def this_cpu_features() -> frozenset[str]:
    """This CPU's feature words (empty where there is no ``/proc/cpuinfo``): what benchmarks print beside
    their figures."""
    return cpu_features(_this_cpuinfo())


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The ``model name`` of this CPU (or of the one ``cpuinfo`` describes), "" where there is none: part of
    the key a measured step budget is cached under (``llm_api.engine.step_budget``)."""
    return _first_field(_this_cpuinfo() if cpuinfo is None else cpuinfo, ("model name",))


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The ``vendor_id`` of this CPU (or of the one ``cpuinfo`` describes): ``GenuineIntel``, ``AuthenticAMD``,
    or "" where there is none (arm, or no ``/proc/cpuinfo``)."""
    return _first_field(_this_cpuinfo() if cpuinfo is None else cpuinfo, ("vendor_id",))


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU (or the one ``cpuinfo``, a ``/proc/cpuinfo`` text, describes) has bfloat16 matrix
    instructions."""
    features = cpu_features(_this_cpuinfo() if cpuinfo is None else cpuinfo)
    return bool(features & X86_BF16_FLAGS) or ARM_BF16_FEATURE in features
