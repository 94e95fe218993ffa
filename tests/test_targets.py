"""The declared FFI targets (jax_megamoe/_targets.py) against what the extension registers and what the C++
and Python sources say: one table, literal names found by grep on both sides, no environment read for
behaviour anywhere in the library."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jax_megamoe import _ffi, _targets

ROOT = Path(__file__).resolve().parents[1]
CXX_SOURCES = sorted(p for p in (ROOT / "cuda").rglob("*") if p.suffix in (".cc", ".cu", ".h", ".cuh", ".hpp"))
PY_SOURCES = sorted((ROOT / "jax_megamoe").rglob("*.py"))
TARGETS = _targets.all_targets()
# The contract (issue 23): every target's literal name and platform.
CONTRACT = {
    "jmm_cpu_moe_layout": "cpu",
    "jmm_cpu_moe_gate_up": "cpu",
    "jmm_cpu_moe_down": "cpu",
    "jmm_cpu_moe_backward": "cpu",
    "jmm_cuda_moe_layout": "CUDA",
    "jmm_cuda_moe_gate_up": "CUDA",
    "jmm_cuda_moe_down": "CUDA",
    "jmm_cuda_moe_backward": "CUDA",
    "jmm_cpu_cross_entropy_rows": "cpu",
    "jmm_cuda_cross_entropy_rows": "CUDA",
    "jmm_cuda_nvlink_exchange": "CUDA",
    "jmm_cuda_nvlink_moe_gate_up": "CUDA",
    "jmm_cuda_nvlink_moe_down": "CUDA",
    "jmm_cuda_nvlink_moe_backward": "CUDA",
    "jmm_cuda_fp8_rows_gemm": "CUDA",
    "jmm_cuda_fp8_weight_gemm": "CUDA",
    "jmm_cuda_fp8_quantize_blocks": "CUDA",
    "jmm_cuda_fp8_quantize_rows": "CUDA",
    "jmm_cuda_fp8_swiglu_rows": "CUDA",
    "jmm_cuda_fp8_token_tiles": "CUDA",
    "jmm_cuda_fp8_swiglu_grad_rows": "CUDA",
}
# The CUDA GEMM targets' tile attributes, each taking only the ones it uses.
TILE_ATTRIBUTES = {
    "jmm_cuda_moe_gate_up": {"fwd_gate_up_tiles"},
    "jmm_cuda_moe_down": {"fwd_down_tiles"},
    "jmm_cuda_moe_backward": {"bwd_down_tiles", "bwd_gate_up_tiles"},
    "jmm_cuda_nvlink_moe_backward": {"bwd_down_tiles", "bwd_gate_up_tiles"},
}


def built_platforms() -> set[str]:
    ext = _ffi.extension()
    assert ext is not None, "the extension is not built (see CONTRACT: build it and copy _ext*.so into jax_megamoe/)"
    return {"cpu", "CUDA"} if _ffi.has_cuda_kernels() else {"cpu"}


def test_each_target_is_declared_once_with_the_contracts_name_and_platform():
    names = [t.name for t in TARGETS]
    assert len(names) == len(set(names)), names
    assert {t.name: t.platform for t in TARGETS} == CONTRACT


def test_the_extension_registers_exactly_the_declared_targets_of_its_platforms():
    registered = set(_ffi.extension().registrations())
    declared = {t.name for t in TARGETS if t.platform in built_platforms()}
    assert registered == declared, (
        f"registered, not declared: {sorted(registered - declared)}; "
        f"declared, not registered: {sorted(declared - registered)}"
    )


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_the_literal_is_registered_in_the_cxx_sources(target):
    """grep for the name finds the C++ registration (a string literal), so the hop Python -> handler is a grep."""
    literal = f'"{target.name}"'
    found = [p.relative_to(ROOT) for p in CXX_SOURCES if literal in p.read_text(errors="replace")]
    assert found, f"no C++ source under cuda/ holds the literal {literal}"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_the_literal_stands_once_in_the_python_table(target):
    table = (ROOT / "jax_megamoe" / "_targets.py").read_text()
    assert table.count(f'"{target.name}"') == 1
    elsewhere = [p.name for p in PY_SOURCES if p.name != "_targets.py" and f'"{target.name}"' in p.read_text()]
    assert elsewhere == [], f"{target.name} is spelled outside the table: {elsewhere}"


def test_no_target_name_is_built_from_parts():
    """No f-string or concatenation builds a target name (grep would not follow it)."""
    pattern = re.compile(r"""f["']jmm_|["']jmm_["']\s*\+|["']jmm_\{|["']jmm_(cpu|cuda)_["']""")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in PY_SOURCES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("target", [t for t in TARGETS if t.workspace_query], ids=lambda t: t.name)
def test_workspace_queries_are_named_after_their_target_and_exist(target):
    assert target.workspace_query == f"{target.name}_workspace_bytes"
    if target.platform in built_platforms():
        assert callable(getattr(_ffi.extension(), target.workspace_query, None)), target.workspace_query


def test_cpu_targets_take_no_workspace():
    assert [t.name for t in TARGETS if t.platform == "cpu" and t.workspace_query] == []


@pytest.mark.parametrize("name, tiles", sorted(TILE_ATTRIBUTES.items()))
def test_gemm_targets_take_only_the_tiles_they_use(name, tiles):
    target = next(t for t in TARGETS if t.name == name)
    assert {a for a in target.attrs if a.endswith("_tiles")} == tiles
    others = [t.name for t in TARGETS if t.name not in TILE_ATTRIBUTES and any(a.endswith("_tiles") for a in t.attrs)]
    assert others == []


def test_aliases_point_at_results_and_operands_that_exist():
    for target in TARGETS:
        for operand, result in target.aliases.items():
            assert isinstance(operand, int) and isinstance(result, int) and operand >= 0 and result >= 0, target


def test_no_library_code_reads_the_environment():
    """Behaviour comes from arguments (GemmConfig, NvlinkWorkspace's timeout_ms and blocks_per_peer), not from
    environment variables read at trace or run time."""
    py = re.compile(r"os\.environ|os\.getenv|getenv\(")
    cxx = re.compile(r"\bgetenv\s*\(|secure_getenv")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in PY_SOURCES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if py.search(line)
    ]
    offenders += [
        f"{p.relative_to(ROOT)}:{n}"
        for p in CXX_SOURCES
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if cxx.search(line)
    ]
    assert offenders == []
