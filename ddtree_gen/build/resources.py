"""The resource model: sympy formulas of spec and tile parameters.

Each kernel's plan (ops/<op>/plan.py) writes its shared memory, threads and register
budget as expressions of the spec symbols below. The generator takes its template constants
from the evaluated plan, refuses a spec whose plan does not fit the chip, prints the formulas
in the build report, and the tests hold them against what ptxas reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ..errors import SpecError
from ..spec import FIELDS, Spec

# Spec symbols: one per int field with an alias (spec.FIELDS), named by the alias.
SYMBOLS = {f.alias: sympy.Symbol(f.alias, positive=True, integer=True) for f in FIELDS if f.symbolic}
H, R, P, N, D, PAGE = (SYMBOLS[a] for a in ("H", "R", "P", "N", "D", "PAGE"))
W = sympy.ceiling(N / 32)  # tree-mask words per row
_SYMBOL_FIELDS = tuple((SYMBOLS[f.alias], f.name) for f in FIELDS if f.symbolic)

# sm_90 (H100 / H200) limits a plan must respect.
SM90_SMEM_PER_BLOCK = 227 * 1024      # opt-in dynamic maximum per block
SM90_STATIC_SMEM = 48 * 1024          # static __shared__ limit without opt-in
SM90_REGS_PER_SM = 65536
SM90_MAX_REGS_PER_THREAD = 255
SM90_MAX_THREADS = 1024
# The smallest opt-in shared memory per block among the datacenter GPUs the sm_80 (PTX) build is
# meant for: A100 (and Jetson Orin), 163 KB. L4 / L40S / RTX 30xx-50xx allow 99 KB, H100 / H200 /
# B200 227 KB. A plan is still checked against the sm_90 limits above (the largest of any target);
# whether a build fits a given device is checked when it is loaded there (runtime.DeviceModules).
SM80_SMEM_PER_BLOCK = 163 * 1024


def symbols_of(spec: Spec) -> dict:
    """The spec's value of every spec symbol."""
    return {sym: getattr(spec, name) for sym, name in _SYMBOL_FIELDS}


def evaluate(expr, spec: Spec) -> int:
    value = sympy.sympify(expr).subs(symbols_of(spec))
    if not value.is_number:
        raise ValueError(f"expression {expr} has free symbols after substitution: {value}")
    return int(value)


@dataclass(frozen=True)
class Plan:
    """What a kernel variant needs, as formulas and as numbers for one spec."""
    kernel: str
    spec: Spec
    threads: sympy.Expr               # threads per block
    min_blocks: int                   # __launch_bounds__ minimum resident blocks per SM
    static_smem: sympy.Expr           # bytes of __shared__ arrays (ptxas "smem")
    dynamic_smem: sympy.Expr = sympy.Integer(0)  # bytes passed at launch
    consts: dict = field(default_factory=dict)   # extra template constants: name -> expr
    build: object = None              # the typed build record it was made of (plans: KernelDef.record), if any

    @property
    def register_budget(self) -> int:
        """Registers per thread that keep min_blocks blocks resident (what ptxas must not exceed)."""
        per_thread = SM90_REGS_PER_SM // (self.value(self.threads) * self.min_blocks)
        per_thread -= per_thread % 8  # registers are allocated per thread in units of 8
        return min(SM90_MAX_REGS_PER_THREAD, per_thread)

    def value(self, expr) -> int:
        return evaluate(expr, self.spec)

    def template_constants(self) -> dict:
        out = {"THREADS": self.value(self.threads), "MIN_BLOCKS": self.min_blocks,
               "STATIC_SMEM": self.value(self.static_smem), "DYNAMIC_SMEM": self.value(self.dynamic_smem)}
        out.update({k: self.value(v) for k, v in self.consts.items()})
        return out

    def formulas(self) -> dict:
        """Formulas for the build report: name -> (expression, value)."""
        rows = {"threads": self.threads, "static_smem": self.static_smem, "dynamic_smem": self.dynamic_smem}
        rows.update(self.consts)
        return {k: (str(v), self.value(v)) for k, v in rows.items()}

    def check_fits(self) -> None:
        """Refuse a spec this plan cannot serve on sm_90, naming the limit."""
        threads, smem = self.value(self.threads), self.value(self.static_smem)
        total = smem + self.value(self.dynamic_smem)
        where = f"spec {self.spec.name!r}, kernel {self.kernel}"
        if not 1 <= threads <= SM90_MAX_THREADS:
            raise SpecError(f"{where}: {threads} threads per block (limit {SM90_MAX_THREADS})")
        if smem > SM90_STATIC_SMEM:
            raise SpecError(f"{where}: {smem} bytes of static shared memory (limit {SM90_STATIC_SMEM}); "
                            f"formula {self.static_smem}")
        if total > SM90_SMEM_PER_BLOCK:
            raise SpecError(f"{where}: {total} bytes of shared memory per block (limit {SM90_SMEM_PER_BLOCK})")


@dataclass(frozen=True)
class PtxasReport:
    """ptxas -v figures for one entry point."""
    registers: int
    smem: int          # static shared memory bytes
    stack: int         # stack frame bytes
    spill_stores: int
    spill_loads: int
    cmem: dict = field(default_factory=dict)
    # ptxas "Potential Performance Loss" notes (C75xx), e.g. wgmma serialized or setmaxnreg ignored:
    # the kernel is correct but not the one the template meant to build
    perf_warnings: tuple = ()

    def as_dict(self) -> dict:
        out = {"registers": self.registers, "smem": self.smem, "stack": self.stack,
               "spill_stores": self.spill_stores, "spill_loads": self.spill_loads}
        if self.perf_warnings:
            out["perf_warnings"] = list(self.perf_warnings)
        return out


def compare(plan: Plan, report: PtxasReport) -> list[str]:
    """Differences between the model and what ptxas built; empty when they agree."""
    problems = []
    want_smem = plan.value(plan.static_smem)
    if report.smem != want_smem:
        problems.append(f"shared memory {report.smem} B, model predicts {want_smem} B ({plan.static_smem})")
    if report.registers > plan.register_budget:
        problems.append(f"{report.registers} registers per thread, model budget {plan.register_budget} "
                        f"({plan.value(plan.threads)} threads x {plan.min_blocks} blocks per SM)")
    if report.spill_stores or report.spill_loads:
        problems.append(f"register spills: {report.spill_stores} B stored, {report.spill_loads} B loaded")
    if report.stack:
        problems.append(f"stack frame of {report.stack} B (local memory); the model predicts none")
    for w in report.perf_warnings:
        problems.append(f"ptxas: {w}")
    return problems
