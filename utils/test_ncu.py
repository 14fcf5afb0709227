"""Parsing Nsight Compute's raw CSV into per-kernel records (CPU only)."""

from utils import ncu

SAMPLE = '''==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum","sm__sass_thread_inst_executed_op_ffma_pred_on.sum","sm__sass_thread_inst_executed_op_fadd_pred_on.sum","sm__sass_thread_inst_executed_op_fmul_pred_on.sum","l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum","l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
"","","","","","nsecond","byte","byte","inst","inst","inst","sector","request"
"0","123","python3","host","naive_qk_kernel(float const*, float*)","2,000","1,000,000","500,000","1,000","10","20","3,200","100"
'''


def test_parse_csv_reads_numbers_and_derives_rates():
    (r,) = ncu.parse_csv(SAMPLE)
    assert r["kernel"].startswith("naive_qk_kernel")
    assert r["time_ns"] == 2000.0
    assert r["dram_bytes"] == 1_500_000.0
    assert r["fp32_flops"] == 2 * 1000 + 10 + 20
    assert r["dram_GBps"] == 1_500_000.0 / 2000.0
    assert r["sectors_per_request"] == 32.0


def test_parse_csv_without_rows():
    assert ncu.parse_csv("==PROF== nothing profiled\n") == []


def test_summarize_has_one_line_per_kernel():
    text = ncu.summarize(ncu.parse_csv(SAMPLE))
    assert len(text.splitlines()) == 2 and "naive_qk_kernel" in text


STALL_SAMPLE = '''"ID","Kernel Name","gpu__time_duration.sum","smsp__warp_issue_stalled_barrier_per_warp_active.pct","smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct","smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct","smsp__warp_issue_stalled_wait_per_warp_active.pct","smsp__warp_issue_stalled_selected_per_warp_active.pct","smsp__issue_active.avg.pct_of_peak_sustained_active"
"","","nsecond","%","%","%","%","%","%"
"0","linear_kernel","1,000","12.5","40.25","3","7","90","61.5"
'''


def test_stall_counters_are_parsed_and_ranked():
    (r,) = ncu.parse_csv(STALL_SAMPLE)
    assert r["stall_long_scoreboard"] == 40.25 and r["issue_active_pct"] == 61.5
    assert ncu.top_stalls(r, 2) == [("long_scoreboard", 40.25), ("barrier", 12.5)]  # "selected" is no stall
    line = ncu.stall_summary(r)
    assert line.startswith("issue slots busy 62%") and "long_scoreboard 40, barrier 12, wait 7" in line


def test_stall_summary_says_when_counters_are_missing():
    assert ncu.stall_summary({"stalls_unavailable": "unknown metric"}).startswith("stall counters unavailable")
    assert ncu.stall_summary({"time_ns": 1.0}) == "no stall counters in this profile"
