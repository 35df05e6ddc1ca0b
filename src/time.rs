//! Time, two ways:
//! - RFC 3339 timestamps as the Kubernetes API writes them, without a date crate (the API needs
//!   only UTC formatting), and the wall clock in milliseconds for what is shown or sent;
//! - the boot clock ([`boot_ms`], [`boot_id`]) for every duration edgehub enforces: deadlines,
//!   holds, expiries. Vehicles boot with a wrong wall clock and jump when GPS or NTP arrives;
//!   CLOCK_BOOTTIME never jumps, keeps counting through suspend, and means the same to a
//!   restarted edgehub within one boot. A point stored with the boot id of another boot says
//!   nothing, and is treated as such by whoever reads it.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Days since 1970-01-01 to (year, month, day), after Howard Hinnant's `civil_from_days`.
fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn parts(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_micros()),
        Err(_) => (0, 0),
    }
}

fn format(secs: i64, micros: Option<u32>) -> String {
    let (y, m, d) = civil(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    let hms = format!("{:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60);
    match micros {
        Some(us) => format!("{y:04}-{m:02}-{d:02}T{hms}.{us:06}Z"),
        None => format!("{y:04}-{m:02}-{d:02}T{hms}Z"),
    }
}

/// `2026-11-29T18:00:00Z`: metav1.Time, as conditions carry it.
pub fn rfc3339(t: SystemTime) -> String {
    format(parts(t).0, None)
}

/// `2026-11-29T18:00:00.000000Z`: metav1.MicroTime, as a Lease's renewTime carries it.
pub fn rfc3339_micros(t: SystemTime) -> String {
    let (s, us) = parts(t);
    format(s, Some(us))
}

/// Days since 1970-01-01 of a civil date (the inverse of [`civil`]).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses a UTC `metav1.Time` (`2026-11-29T18:00:00Z`, fractions ignored) to Unix seconds.
pub fn parse_rfc3339(t: &str) -> Option<i64> {
    let b = t.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    if !t.ends_with('Z') {
        return None;
    }
    let n = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (h, mi, s) = (n(11..13)?, n(14..16)?, n(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    Some(days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + s)
}

/// Milliseconds since the Unix epoch (0 if the clock is before it), as the store records times.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn now() -> String {
    rfc3339(SystemTime::now())
}

/// Milliseconds on CLOCK_BOOTTIME: since this boot, never set, never jumping.
pub fn boot_ms() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_BOOTTIME exists on every Linux
    // edgehub supports (2.6.39 and later).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        // Not expected on Linux; the monotonic clock is the next best (it stops in suspend).
        return std::time::Instant::now()
            .duration_since(*process_start())
            .as_millis() as i64;
    }
    // time_t and c_long are i64 on the 64-bit targets, narrower elsewhere.
    #[allow(clippy::unnecessary_cast)]
    let ms = ts.tv_sec as i64 * 1000 + ts.tv_nsec as i64 / 1_000_000;
    ms
}

fn process_start() -> &'static std::time::Instant {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START.get_or_init(std::time::Instant::now)
}

/// The kernel's id of this boot: a point on [`boot_ms`] is meaningful only with the same id.
/// Without /proc (never on a device), an id of this process, so nothing stored is trusted
/// across a restart.
pub fn boot_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("process-{}-{}", std::process::id(), now_ms()))
    })
}

/// A point on the boot clock as stored: readable only in the boot it was taken in.
pub fn boot_point(stored_boot: Option<&str>, ms: Option<i64>) -> Option<i64> {
    ms.filter(|_| stored_boot == Some(boot_id()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_975_200);
        assert_eq!(rfc3339(t), "2026-11-29T18:00:00Z");
        assert_eq!(
            rfc3339_micros(t + Duration::from_micros(10_000_042)),
            "2026-11-29T18:00:10.000042Z"
        );
        // Leap day and year boundaries.
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_735_689_599)),
            "2024-12-31T23:59:59Z"
        );
    }

    #[test]
    fn the_boot_clock_moves_forward_and_knows_its_boot() {
        let a = boot_ms();
        std::thread::sleep(Duration::from_millis(20));
        let b = boot_ms();
        assert!(b - a >= 20, "{a} {b}");
        assert!(a > 0);
        assert_eq!(boot_id().len(), 36, "{}", boot_id());
        assert_eq!(boot_point(Some(boot_id()), Some(5)), Some(5));
        assert_eq!(boot_point(Some("another-boot"), Some(5)), None);
        assert_eq!(boot_point(None, Some(5)), None);
    }

    #[test]
    fn parses_what_it_formats() {
        for secs in [0, 951_782_400, 1_735_689_599, 1_795_975_200] {
            let t = rfc3339(UNIX_EPOCH + Duration::from_secs(secs));
            assert_eq!(parse_rfc3339(&t), Some(secs as i64), "{t}");
        }
        assert_eq!(
            parse_rfc3339("2026-11-29T19:41:04.123456Z"),
            parse_rfc3339("2026-11-29T19:41:04Z")
        );
        for bad in [
            "",
            "2026-11-29",
            "2026-13-01T00:00:00Z",
            "2026-11-29T18:00:00+01:00",
            "x026-11-29T18:00:00Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
