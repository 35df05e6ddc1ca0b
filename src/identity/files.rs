//! The node credential on flash: one PEM file, the certificate then its key, 0600 in the data
//! dir (as the kubelet's `kubelet-client-current.pem`), written to a temporary file, synced
//! and renamed, so a power cut leaves the old file or the new one, never half of one.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The credential file under `data_dir`.
pub fn credential_path(data_dir: &Path) -> PathBuf {
    data_dir.join("identity").join("node-client.pem")
}

/// The serving certificate file under `data_dir` (certificate then key, as the credential
/// file; the kubelet's `kubelet-server-current.pem`).
pub fn serving_path(data_dir: &Path) -> PathBuf {
    data_dir.join("identity").join("node-serving.pem")
}

/// Writes `contents` to `path` atomically, mode 0600, the directory made 0700 if missing.
/// Returns the bytes written (what a rotation costs the flash).
pub fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<u64> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("credential path has no directory"))?;
    if !dir.exists() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("credential")
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(contents)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(contents.len() as u64)
}

/// Splits the credential file into (certificate PEM, key PEM).
pub fn split(text: &str) -> Option<(String, String)> {
    let key_at = text
        .find("-----BEGIN PRIVATE KEY-----")
        .or_else(|| text.find("-----BEGIN EC PRIVATE KEY-----"))?;
    let (cert, key) = text.split_at(key_at);
    cert.contains("-----BEGIN CERTIFICATE-----").then(|| {
        (
            cert.trim().to_string() + "\n",
            key.trim().to_string() + "\n",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_private_and_whole() {
        let d = tempfile::tempdir().unwrap();
        let p = credential_path(d.path());
        write_private(&p, b"-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nB\n-----END PRIVATE KEY-----\n").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = std::fs::metadata(p.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        let (c, k) = split(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert!(c.contains("CERTIFICATE") && !c.contains("PRIVATE"));
        assert!(k.contains("PRIVATE KEY"));
        assert!(split("no key here").is_none());
    }
}
