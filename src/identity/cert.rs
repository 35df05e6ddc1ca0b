//! What edgehub reads of its own client certificate, pure: the validity window and the
//! subject's common name, from the DER, without an X.509 crate (a few TLVs are all it takes),
//! and when to rotate it.

use base64::Engine;

/// The parts of a certificate the identity task decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertTimes {
    /// Unix seconds.
    pub not_before: i64,
    pub not_after: i64,
    pub common_name: Option<String>,
}

/// The first `CERTIFICATE` block of a PEM text, as DER.
pub fn first_pem_cert(pem: &str) -> Result<Vec<u8>, String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let start = pem.find(BEGIN).ok_or("no PEM CERTIFICATE block")? + BEGIN.len();
    let len = pem[start..]
        .find(END)
        .ok_or("unterminated PEM CERTIFICATE block")?;
    let b64: String = pem[start..start + len]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("PEM CERTIFICATE block is not base64: {e}"))
}

/// One DER TLV: (tag, content, rest).
fn tlv(input: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
    let (&tag, rest) = input.split_first().ok_or("truncated DER")?;
    let (&first, rest) = rest.split_first().ok_or("truncated DER length")?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return Err("bad DER length".into());
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return Err("DER value longer than its input".into());
    }
    Ok((tag, &rest[..len], &rest[len..]))
}

/// Days from 1970-01-01 to a civil date (Howard Hinnant's days_from_civil).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) as unix seconds.
fn der_time(tag: u8, v: &[u8]) -> Result<i64, String> {
    let s = std::str::from_utf8(v).map_err(|_| "time is not ASCII")?;
    let s = s.strip_suffix('Z').ok_or("time is not in UTC")?;
    let (year, rest) = match tag {
        0x17 if s.len() == 12 => {
            let yy: i64 = s[..2].parse().map_err(|_| "bad UTCTime")?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &s[2..])
        }
        0x18 if s.len() == 14 => (s[..4].parse().map_err(|_| "bad GeneralizedTime")?, &s[4..]),
        _ => return Err("not a UTCTime or GeneralizedTime".into()),
    };
    let n = |i: usize| -> Result<i64, String> {
        rest.get(i..i + 2)
            .and_then(|x| x.parse().ok())
            .ok_or_else(|| "bad time digits".to_string())
    };
    let (mo, d, h, mi, se) = (n(0)?, n(2)?, n(4)?, n(6)?, n(8)?);
    Ok(days_from_civil(year, mo, d) * 86_400 + h * 3600 + mi * 60 + se)
}

/// The validity and subject CN of a DER certificate.
pub fn parse(der: &[u8]) -> Result<CertTimes, String> {
    let (_, cert, _) = tlv(der)?;
    let (_, tbs, _) = tlv(cert)?;
    let (mut tag, mut v, mut rest) = tlv(tbs)?;
    if tag == 0xa0 {
        (tag, v, rest) = tlv(rest)?; // the version; next the serial
    }
    let _ = (tag, v);
    let (_, _, rest) = tlv(rest)?; // signature algorithm
    let (_, _, rest) = tlv(rest)?; // issuer
    let (_, validity, rest) = tlv(rest)?;
    let (t1, nb, vr) = tlv(validity)?;
    let (t2, na, _) = tlv(vr)?;
    let (_, subject, _) = tlv(rest)?;
    Ok(CertTimes {
        not_before: der_time(t1, nb)?,
        not_after: der_time(t2, na)?,
        common_name: common_name(subject)?,
    })
}

/// The subject of a DER certificate as the apiserver's x509 authenticator reads it: the CN
/// is the user, each O a group.
pub fn subject_user(der: &[u8]) -> Result<(Option<String>, Vec<String>), String> {
    let (_, cert, _) = tlv(der)?;
    let (_, tbs, _) = tlv(cert)?;
    let (tag, _, mut rest) = tlv(tbs)?;
    if tag == 0xa0 {
        (_, _, rest) = tlv(rest)?; // the serial
    }
    let (_, _, rest) = tlv(rest)?; // signature algorithm
    let (_, _, rest) = tlv(rest)?; // issuer
    let (_, _, rest) = tlv(rest)?; // validity
    let (_, subject, _) = tlv(rest)?;
    const O: &[u8] = &[0x55, 0x04, 0x0a];
    let mut orgs = Vec::new();
    let mut name = subject;
    while !name.is_empty() {
        let (_, set, r) = tlv(name)?;
        name = r;
        let mut set = set;
        while !set.is_empty() {
            let (_, atv, r) = tlv(set)?;
            set = r;
            let (_, oid, vr) = tlv(atv)?;
            if oid == O {
                let (_, value, _) = tlv(vr)?;
                orgs.push(String::from_utf8_lossy(value).into_owned());
            }
        }
    }
    Ok((common_name(subject)?, orgs))
}

/// The CN of a Name (SEQUENCE of SET of SEQUENCE { OID, value }).
fn common_name(mut name: &[u8]) -> Result<Option<String>, String> {
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    while !name.is_empty() {
        let (_, set, rest) = tlv(name)?;
        name = rest;
        let (_, atv, _) = tlv(set)?;
        let (_, oid, vr) = tlv(atv)?;
        if oid == CN {
            let (_, value, _) = tlv(vr)?;
            return Ok(Some(String::from_utf8_lossy(value).into_owned()));
        }
    }
    Ok(None)
}

/// The kubelet's jittered deadline: a random point between 70 % and 90 % of the window
/// (`jitter` in 0..=1 picks where).
pub fn rotation_at(c: &CertTimes, jitter: f64) -> i64 {
    let span = (c.not_after - c.not_before).max(0) as f64;
    c.not_before + (span * (0.7 + 0.2 * jitter.clamp(0.0, 1.0))).round() as i64
}

/// Where a credential stands at `now` (unix seconds) on the device's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// The clock is behind notBefore (a vehicle that booted at 1970): keep it, and wait.
    NotYetValid,
    Valid {
        rotate_at: i64,
    },
    Expired,
}

pub fn standing(c: &CertTimes, now: i64, jitter: f64) -> Standing {
    if now < c.not_before {
        Standing::NotYetValid
    } else if now >= c.not_after {
        Standing::Expired
    } else {
        Standing::Valid {
            rotate_at: rotation_at(c, jitter),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_days_and_times() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(der_time(0x17, b"261202011313Z").unwrap(), 1_796_173_993);
        assert_eq!(der_time(0x18, b"20261202011313Z").unwrap(), 1_796_173_993);
        assert!(der_time(0x17, b"2612020113Z").is_err());
        assert!(der_time(0x17, b"261202011313+0100").is_err());
    }

    #[test]
    fn the_window_decides() {
        let c = CertTimes {
            not_before: 1000,
            not_after: 2000,
            common_name: None,
        };
        assert_eq!(rotation_at(&c, 0.0), 1700);
        assert_eq!(rotation_at(&c, 1.0), 1900);
        assert_eq!(standing(&c, 999, 0.5), Standing::NotYetValid);
        assert_eq!(standing(&c, 1500, 0.5), Standing::Valid { rotate_at: 1800 });
        assert_eq!(standing(&c, 2000, 0.5), Standing::Expired);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"\x30",
            b"\x30\x85\x00",
            b"\x30\x02\x30\x05",
            b"\x30\x00",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(first_pem_cert("nothing").is_err());
        assert!(
            first_pem_cert("-----BEGIN CERTIFICATE-----\n%%%\n-----END CERTIFICATE-----").is_err()
        );
    }
}
