"""The compiler report: ptxas -v logs parsed into per-kernel records, and the occupancy they allow."""

from utils.compiler_report import parse_ptxas, theoretical_occupancy
from utils.compiler_report import SM90_LIMITS

LOG = """ptxas info    : Compiling entry function '_ZN12phase3_tiled15tiled_qk_kernelILi16EEEvPKf' for 'sm_90'
ptxas info    : Function properties for _ZN12phase3_tiled15tiled_qk_kernelILi16EEEvPKf
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN12phase3_tiled20block_softmax_kernelEPf' for 'sm_90'
ptxas info    : Used 18 registers, 380 bytes cmem[0]
"""


def test_parse_ptxas_reads_registers_smem_spills_and_tile():
    qk, softmax = parse_ptxas(LOG)
    assert (qk["registers"], qk["smem_bytes"], qk["spill_stores"], qk["spill_loads"], qk["tile"]) == (40, 2048, 8, 4, 16)
    assert qk["name"].endswith("<16>")
    assert (softmax["registers"], softmax["smem_bytes"], softmax["tile"]) == (18, 0, None)


def test_occupancy_names_the_limiting_resource():
    # 256 threads at 128 registers: 32 KiB of registers per block, two blocks fit in 64 K registers.
    by_registers = theoretical_occupancy(256, 128, 0, SM90_LIMITS)
    assert by_registers["blocks_per_sm"] == 2 and by_registers["limited_by"] == "registers"
    assert by_registers["occupancy_pct"] == 25.0
    # 48 KiB of shared memory per block: 4 blocks of 228 KiB (1 KiB reserved each).
    by_smem = theoretical_occupancy(128, 32, 48 * 1024, SM90_LIMITS)
    assert by_smem["blocks_per_sm"] == 4 and by_smem["limited_by"] == "shared_memory"
