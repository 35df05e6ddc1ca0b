//! Resource quantities and limits: the CPU and memory a container asks for, as the CRI's
//! Linux resources.

use super::*;

/// CPU quantity in millicores ("200m", "1", "0.5").
pub fn parse_cpu_millis(q: &str) -> Option<i64> {
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    q.parse::<f64>().ok().map(|c| (c * 1000.0).round() as i64)
}

/// Memory quantity in bytes ("64Mi", "1G", "128974848", "1.5Gi").
pub fn parse_bytes(q: &str) -> Option<i64> {
    const SUFFIXES: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    for (suf, mul) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suf) {
            return n.parse::<f64>().ok().map(|v| (v * mul) as i64);
        }
    }
    q.parse::<f64>().ok().map(|v| v as i64)
}

pub(super) fn resources(
    c: &Value,
    field: &str,
) -> Result<api::LinuxContainerResources, Unsupported> {
    let mut r = api::LinuxContainerResources::default();
    if let Some(cpu) = c.pointer("/resources/limits/cpu").and_then(Value::as_str) {
        let m = parse_cpu_millis(cpu).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.limits.cpu"),
                format!("bad quantity {cpu:?}"),
            )
        })?;
        r.cpu_period = 100_000;
        r.cpu_quota = (m * 100).max(1000);
    }
    let req_cpu = c
        .pointer("/resources/requests/cpu")
        .or_else(|| c.pointer("/resources/limits/cpu"));
    if let Some(cpu) = req_cpu.and_then(Value::as_str) {
        let m = parse_cpu_millis(cpu).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.requests.cpu"),
                format!("bad quantity {cpu:?}"),
            )
        })?;
        // The kubelet's milliCPU -> shares conversion, clamped to the kernel's minimum.
        r.cpu_shares = (m * 1024 / 1000).max(2);
    }
    if let Some(mem) = c
        .pointer("/resources/limits/memory")
        .and_then(Value::as_str)
    {
        r.memory_limit_in_bytes = parse_bytes(mem).ok_or_else(|| {
            unsupported(
                format!("{field}.resources.limits.memory"),
                format!("bad quantity {mem:?}"),
            )
        })?;
    }
    Ok(r)
}
