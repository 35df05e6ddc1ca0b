#!/usr/bin/env python3
"""The numbers of benches/run.sh: medians of the benches' `METRIC key value unit` lines.

    report.py --json OUT.json METRICS.txt   # medians to OUT.json (key -> number), units and
                                            # ranges to OUT-detail.json, the table on stdout
    report.py --readme NUMBERS.json         # docs/numbers.md's table (every number) and README's
                                            # (the budgeted ones) between their markers, regenerated

A key printed more than once (one line per run or per sample) is reported as the median of
its values, with the number of values and their range beside it.
"""
import json
import statistics
import sys
from pathlib import Path

# key, what, budget (a maximum, or None), reference or note. The order of the table.
ROWS = [
    ("binary_bytes_aarch64", "static aarch64 musl binary, stripped", 5_000_000,
     "yurthub ≈ 19 MB compressed; edgecore 48 MB"),
    ("binary_bytes_x86_64", "static x86_64 musl binary, stripped", None, ""),
    ("rss_idle_kib_0_pods", "idle RSS, 0 pods cached (runtime absent)", None, ""),
    ("rss_idle_kib_100_pods", "idle RSS, 100 pods cached (runtime absent)", 6 * 1024,
     "yurthub 30–40 MB; Ankaios agent 5.6 MiB"),
    ("rss_idle_kib_1000_pods", "idle RSS, 1000 pods cached (runtime absent)", None, ""),
    ("rss_peak_kib_100_pods", "peak RSS (VmHWM) on the way, 100 pods", None, ""),
    ("rss_peak_kib_1000_pods", "peak RSS (VmHWM) on the way, 1000 pods", None, ""),
    ("rss_anon_kib_100_pods", "  of which anonymous (heap, stacks, SQLite's cache), 100 pods",
     None, ""),
    ("rss_file_kib_100_pods", "  of which the binary's pages, 100 pods", None, ""),
    ("rss_anon_kib_0_pods", "anonymous RSS, 0 pods", None, ""),
    ("rss_anon_kib_1000_pods", "anonymous RSS, 1000 pods", None, ""),
    ("threads_idle_100_pods", "threads, idle, 100 pods", None, ""),
    ("rss_kib_20_running_pods", "RSS with 20 running pods", None, ""),
    ("cold_start_offline_ms_100_pods", "cold start offline to /v1/readyz 200, 100 pods cached",
     100, "OpenYurt#858: about 1 min to recover pods after an offline reboot"),
    ("get_pods_p99_ms_100_pods", "GET /pods p99, 100 pods, one client", 1, ""),
    ("get_pods_p99_ms_100_pods_16_clients", "GET /pods p99, 100 pods, 16 concurrent clients "
     "(keep-alive, each connection's first request apart)", 5, ""),
    ("get_pods_first_worst_ms_100_pods_16_new_connections", "  the first request of 16 new "
     "connections opened at once, the worst", None, ""),
    ("get_pods_p99_ms_1000_pods", "GET /pods p99, 1000 pods, one client", 10, ""),
    ("get_pods_p99_ms_100_pods_online", "GET /pods p99, 100 pods, one client, a pod changed "
     "every second", 1, ""),
    ("get_pods_p99_ms_100_pods_16_clients_online", "GET /pods p99, 100 pods, 16 clients, a pod "
     "changed every second", 5, ""),
    ("get_pods_p99_ms_1000_pods_online", "GET /pods p99, 1000 pods, one client, a pod changed "
     "every second", 10, ""),
    ("get_pods_per_s_100_pods_4_connections", "GET /pods per second, 100 pods, 4 connections",
     None, ""),
    ("initial_sync_ms_100_pods", "initial sync, 100 pods, over TLS into SQLite", None, ""),
    ("initial_sync_ms_1000_pods", "initial sync, 1000 pods", None, ""),
    ("store_events_per_s", "watch events applied, store only", None, ""),
    ("watch_events_per_s_end_to_end", "watch events applied, end to end over TLS", None, ""),
    ("bytes_written_per_1000_unchanged_events", "bytes written per 1000 unchanged events", None,
     ""),
    ("bytes_written_per_1000_bookmarks", "bytes written per 1000 bookmarks", None, ""),
    ("pod_start_overhead_ms_per_pod", "pod start, edgehub minus containerd alone, per pod (20 pods)",
     None, "same run, same pods"),
    ("pod_ready_overhead_ms", "pod cache → Ready, sources not cached, authorizer lag 500 ms, "
     "minus containerd's own work", 1000, ""),
    ("upgrade_overhead_ms", "offline in-place upgrade, minus containerd's own swap", 300,
     "Ankaios rolling update 1455 ms vs K3s 2101 ms"),
    ("upgrade_ms", "offline in-place upgrade, POST → new container running", None, ""),
    ("txn_install_overhead_ms", "transaction install → Verified, minus containerd's own work, "
     "per pod", 300, "benches/upgrade/txn.rs"),
    ("txn_rollback_overhead_ms", "rollback from Verified → old revision ready, minus "
     "containerd's own work", 500, ""),
    ("txn_flash_write_bytes_two_pods", "flash written by one transaction of two pods, request → "
     "Committed", None, "write_bytes of /proc/PID/io"),
    ("hostile_imagepull_300_write_bytes", "flash written by 300 identical imagepull POSTs after "
     "the pre-pull is done", 64 * 1024, "benches/hostile.rs; was 11 MB"),
    ("hostile_archive_rss_over_idle_mib", "peak RSS over idle while three hostile archives "
     "(1 GiB declared, 1 MiB sent) are refused", 32, "was 1 GiB and more"),
    ("hostile_silent_logs_median_ms", "the apiserver's logs request with 64 silent connections "
     "held on 10250, median", None, "was: no answer"),
    ("hostile_silent_logs_unanswered", "  of 20 such requests, unanswered", 0, ""),
    ("image_import_mb_per_s", "side-load of a 100 MB oci-archive, edgehub images load", None,
     "benches/images.rs"),
    ("ctr_import_mb_per_s", "  the same file by ctr images import --no-unpack, same run", None, ""),
    ("image_import_vs_ctr_percent", "  edgehub's throughput as a share of ctr's", None,
     "budget: at least 80 %"),
    ("image_import_peak_rss_over_idle_kib", "edgehub's peak RSS during that import, over idle",
     None, "budget: +4096 KiB (it streams)"),
    ("restart_ms_alone", "killed container → running again (backoff 100 ms)", None, ""),
    ("apiserver_requests_per_device_reconnect", "apiserver requests per device for a reconnect "
     "after a 40 s cut (the Lease renewal and the watches; later Lease renewals left out)", 8,
     "benches/fleet.rs, with jitter"),
    ("apiserver_version_checks_per_device_reconnect", "  of which limit=1 resourceVersion checks",
     None, "0: the watch itself says when the cursor is in doubt"),
    ("power_cycle_running_overhead_ms", "offline power cycle, exec to every container running, "
     "minus containerd's own work", 300, "benches/startup.rs"),
    ("pod_ready_after_node_ready_overhead_ms", "pods bound right after node Ready to Ready, minus "
     "containerd's own work", None, "benches/startup.rs"),
    ("idle_cpu_s_per_minute_2_probed_pods", "idle CPU (utime + stime) per minute, online, the 2 "
     "recorded DaemonSet pods (an exec readiness probe every 2 s each)", 0.15,
     "the stock kubelet beside the same 2 pods: 0.57 s"),
    ("idle_context_switches_per_minute_2_probed_pods", "context switches per idle minute, the same "
     "process (its wake-ups: the work, without the VM's speed)", None, ""),
    ("apiserver_requests_per_pod_per_idle_minute", "apiserver requests per pod per idle minute",
     None, "0 beyond the node's Lease"),
    ("flash_write_kib_per_hour_device_key", "flash writes at steady state with a device key, 5 "
     "pods with probes and tokens, per hour at the shipped cadence (median of 3 windows)", 75,
     "write_bytes of /proc/PID/io"),
    ("flash_write_kib_per_hour_worst_device_key", "  the worst of the 3 windows", 75, ""),
    ("flash_write_kib_per_hour", "flash writes at steady state without a key, 5 pods with probes "
     "and tokens, per hour at the shipped cadence", 75, "write_bytes of /proc/PID/io"),
    ("flash_write_bytes_per_token_round_5_pods",
     "  of which one round of 5 token renewals, the parked cursors riding along (1.25 an hour)",
     None, ""),
    ("flash_write_kib_per_hour_no_tokens", "flash writes at steady state, pods without tokens",
     75, ""),
    ("flash_write_bytes_per_cursor_checkpoint",
     "  of which one cursor checkpoint (1 an hour, only when no token round carries it)",
     None, ""),
    ("flash_write_kib_per_hour_background", "  of which everything else (probes, Leases, "
     "bookmarks, Node status)", None, ""),
    ("seal_flash_bytes_per_token_round_5_pods_clear",
     "one round of 5 token renewals, store only, tokens in the clear", None, "benches/seal.rs"),
    ("seal_flash_bytes_per_token_round_5_pods_sealed",
     "  the same, tokens sealed with a device key", None, ""),
    ("seal_cpu_us_per_pod_start_clear", "CPU to read a pod's Secret and token from the cache, "
     "in the clear", None, ""),
    ("seal_cpu_us_per_pod_start_sealed", "  the same, sealed", None, ""),
    ("seal_us_per_token", "AES-256-GCM seal of one 1.1 KB token", None, ""),
    ("open_us_per_token", "AES-256-GCM open of one 1.1 KB token", None, ""),
    ("flash_growth_kib_per_hour", "data dir growth at steady state", None, ""),
    ("apiserver_requests_per_idle_minute", "apiserver requests per idle minute, one device",
     None, "Lease renewals"),
    ("apiserver_requests_per_device_link_flap", "apiserver requests per device after a 2-min cut",
     None, "with jitter"),
    ("apiserver_requests_per_device_link_flap_no_jitter", "the same, without jitter", None, ""),
    ("apiserver_requests_per_device_link_flap_net_of_idle",
     "the same, minus what an idle device sends in as long (Leases)", None, "with jitter"),
    ("apiserver_requests_per_device_link_flap_net_of_idle_no_jitter",
     "the same, minus the idle Leases, without jitter", None, ""),
    ("apiserver_lists_per_device_link_flap", "LISTs per device after the cut", None,
     "0: every watch resumes"),
    ("apiserver_lists_per_device_link_flap_no_jitter", "LISTs per device, without jitter", None,
     ""),
    ("apiserver_peak_requests_per_s_50_devices", "peak requests/s at the server, 50 devices",
     None, "with jitter"),
    ("apiserver_peak_requests_per_s_50_devices_no_jitter",
     "peak requests/s at the server, 50 devices, without jitter", None, ""),
    ("fleet_caught_up_s", "every device caught up after the restore", None, "with jitter"),
    ("fleet_caught_up_s_no_jitter", "every device caught up, without jitter", None, ""),
]
# The keys issue 14 asked numbers.json for.
REQUIRED = [
    "binary_bytes_aarch64", "binary_bytes_x86_64", "rss_idle_kib_0_pods",
    "rss_idle_kib_100_pods", "rss_idle_kib_1000_pods", "cold_start_offline_ms_100_pods",
    "get_pods_p99_ms_100_pods", "get_pods_p99_ms_100_pods_16_clients",
    "pod_start_overhead_ms_per_pod", "upgrade_overhead_ms", "flash_write_kib_per_hour",
    "apiserver_requests_per_device_link_flap",
]
BEGIN = "<!-- numbers:begin (generated by `bash benches/run.sh --readme`; do not edit) -->"
END = "<!-- numbers:end -->"


def fmt(v, unit):
    if unit == "B" and v >= 100_000:
        return f"{v:,.0f} B ({v / 1e6:.2f} MB)"
    if unit == "KiB" and v >= 1024:
        return f"{v:,.0f} KiB ({v / 1024:.1f} MiB)"
    if abs(v) >= 100 or v == int(v):
        s = f"{v:,.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return f"{s} {unit}".strip()


def collect(path):
    vals, units = {}, {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "METRIC":
            continue
        try:
            v = float(parts[2])
        except ValueError:
            continue
        vals.setdefault(parts[1], []).append(v)
        units[parts[1]] = parts[3] if len(parts) > 3 else ""
    return {
        k: {
            "median": statistics.median(v),
            "unit": units[k],
            "samples": len(v),
            "min": min(v),
            "max": max(v),
        }
        for k, v in vals.items()
    }


def table(data, budgeted_only=False):
    known = [r[0] for r in ROWS]
    rows = [r for r in ROWS if r[0] in data]
    rows += [(k, k, None, "") for k in sorted(data) if k not in known]
    if budgeted_only:
        rows = [r for r in rows if r[2] is not None]
    out = ["| what | key | measured (median) | budget / reference | |",
           "| --- | --- | --- | --- | --- |"]
    for key, what, budget, ref in rows:
        d = data[key]
        m = fmt(d["median"], d["unit"])
        if d["samples"] > 1 and d["min"] != d["max"]:
            m += f" ({d['samples']} values, {fmt(d['min'], '')}–{fmt(d['max'], '')})"
        status = ""
        b = ""
        if budget is not None:
            b = f"≤ {fmt(budget, d['unit'])}"
            status = "OVER" if d["median"] > budget else "ok"
        br = "; ".join(x for x in (b, ref) if x)
        out.append(f"| {what} | `{key}` | {m} | {br} | {status} |")
    return "\n".join(out)


def detail(numbers_json):
    """Units, sample counts and ranges beside numbers.json (which holds only the medians)."""
    return numbers_json.with_name(numbers_json.stem + "-detail.json")


def main():
    if sys.argv[1] == "--json":
        data = collect(sys.argv[3])
        numbers = {k: (round(v["median"], 3)) for k, v in sorted(data.items())}
        out = Path(sys.argv[2])
        out.write_text(json.dumps(numbers, indent=2) + "\n")
        detail(out).write_text(json.dumps(data, indent=2) + "\n")
        print(table(data))
        over = [r[0] for r in ROWS if r[2] is not None and r[0] in data
                and data[r[0]]["median"] > r[2]]
        missing = [k for k in REQUIRED if k not in data]
        print(f"\n{sys.argv[2]} written; over budget: {', '.join(over) or 'none'}")
        if missing:
            print(f"not measured this time: {', '.join(missing)}")
    elif sys.argv[1] == "--readme":
        data = json.loads(detail(Path(sys.argv[2])).read_text())
        root = Path(__file__).resolve().parent.parent
        # every number in docs/numbers.md; the ones with a budget in the README
        for doc, budgeted_only in (("docs/numbers.md", False), ("README.md", True)):
            path = root / doc
            text = path.read_text()
            if BEGIN not in text or END not in text:
                sys.exit(f"{doc} has no numbers markers")
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            path.write_text(f"{head}{BEGIN}\n{table(data, budgeted_only)}\n{END}{tail}")
            print(f"{doc} numbers table regenerated")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
