//! Pod volumes on the host: directories for `emptyDir`, checks for `hostPath`, and the files
//! of `configMap`, `secret`, `downwardAPI` and `projected` volumes.
//!
//! File volumes are written the way the kubelet's AtomicWriter does it, because containers
//! read them while they change (a token renewal, a ConfigMap edit):
//!
//! ```text
//! <volume>/..2026_11_29_21_40_00.123456789/app.conf   the payload, one directory per version
//! <volume>/..data -> ..2026_11_29_21_40_00.123456789   swapped with one rename(2)
//! <volume>/app.conf -> ..data/app.conf                 stable names for the container
//! ```
//!
//! A reader sees the old version or the new one, never a mix, and a power cut leaves one of
//! them in place. An unchanged payload is not rewritten (flash wear).

use crate::podspec::{PodContext, PodPlan, Unsupported, VolumeFile, VolumePlan};
use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

const DATA: &str = "..data";

fn fail(name: &str, reason: String) -> Unsupported {
    Unsupported {
        field: format!("volume {name}"),
        reason,
    }
}

fn mkdir(path: &Path, mode: u32) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
}

/// Creates what the pod's volumes need on the host, checks hostPath types and writes file
/// volumes. Returns how many file volumes changed.
pub fn prepare(plan: &PodPlan, ctx: &PodContext) -> Result<usize, Unsupported> {
    mkdir(&ctx.log_dir, 0o750).map_err(|e| {
        fail(
            "logs",
            format!("cannot create {}: {e}", ctx.log_dir.display()),
        )
    })?;
    let mut changed = 0;
    for v in &plan.volumes {
        match v {
            VolumePlan::EmptyDir { name, path } => mkdir(path, 0o777)
                .map_err(|e| fail(name, format!("cannot create {}: {e}", path.display())))?,
            VolumePlan::HostPath { name, path, kind } => check_host_path(name, path, kind)?,
            VolumePlan::Files {
                name,
                path,
                files,
                memory,
            } => {
                if *memory {
                    in_memory(path);
                }
                if write_files(path, files)
                    .map_err(|e| fail(name, format!("cannot write {}: {e}", path.display())))?
                {
                    changed += 1;
                }
            }
        }
    }
    Ok(changed)
}

/// Rewrites only the file volumes (on every pass, so renewed tokens and edited ConfigMaps
/// reach running containers). Returns how many changed.
pub fn refresh_files(plan: &PodPlan) -> Result<usize, Unsupported> {
    let mut changed = 0;
    for v in &plan.volumes {
        if let VolumePlan::Files {
            name,
            path,
            files,
            memory,
        } = v
        {
            if *memory {
                in_memory(path);
            }
            if write_files(path, files)
                .map_err(|e| fail(name, format!("cannot write {}: {e}", path.display())))?
            {
                changed += 1;
            }
        }
    }
    Ok(changed)
}

/// Puts a volume's directory on its own tmpfs, as the kubelet does for Secret, projected and
/// downwardAPI volumes, so secrets and tokens never reach flash. Where a tmpfs cannot be
/// mounted (no CAP_SYS_ADMIN, a read-only /proc), the files go to disk and a warning says so.
///
/// When edgehub runs in another mount namespace than the container runtime (see mountns.rs),
/// the tmpfs must be the same one in both, or the container gets the empty directory under
/// it: a tmpfs the runtime already has there (a pod from before this edgehub started) is
/// taken over, a new one is attached in the runtime's namespace too. Where that fails the
/// tmpfs goes again, so that the files reach the container, from disk, with an error that
/// says why.
fn in_memory(path: &Path) {
    if let Err(e) = mkdir(path, 0o755) {
        tracing::warn!(dir = %path.display(), error = %e, "cannot create the volume directory");
        return;
    }
    let runtime = crate::mountns::foreign_runtime();
    if let Some(pid) = runtime {
        if !is_mount_point(path) && crate::mountns::is_mount_point_for(pid, path) {
            if let Err(e) = crate::mountns::import(pid, path) {
                tracing::warn!(dir = %path.display(), error = %e,
                    "cannot take over the runtime's tmpfs for this volume");
            }
        }
    }
    if !is_mount_point(path) {
        match mount_tmpfs(path) {
            Ok(()) => tracing::debug!(dir = %path.display(), "volume on tmpfs"),
            Err(e) => {
                tracing::warn!(dir = %path.display(), error = %e,
                    "cannot mount a tmpfs for this volume; its files (Secrets, tokens) are written to disk");
                return;
            }
        }
    }
    let Some(pid) = runtime else { return };
    if crate::mountns::same_mount(pid, path) {
        return;
    }
    if let Err(e) = crate::mountns::export(pid, path) {
        tracing::error!(dir = %path.display(), runtime_pid = pid, error = %e,
            "the container runtime cannot see this volume's tmpfs (edgehub is in another mount namespace) and it cannot be attached there: the files (Secrets, tokens) are written to disk instead, so the container gets them");
        unmount(path);
    }
}

fn unmount(path: &Path) {
    let Ok(target) = cstr(path) else { return };
    // SAFETY: a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(dir = %path.display(), error = %e, "cannot unmount a volume");
    }
}

pub use crate::mountns::is_mount_point;

fn cstr(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has a NUL byte"))
}

fn mount_tmpfs(path: &Path) -> std::io::Result<()> {
    let target = cstr(path)?;
    let fstype = c"tmpfs";
    let data = c"mode=0755";
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Mount points at or under `dir`, deepest first, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let unescape = |s: &str| {
        s.replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\012", "\n")
            .replace("\\134", "\\")
    };
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape(m)))
        .filter(|m| m.starts_with(dir))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// Removes a pod's directory: its tmpfs volumes are unmounted first (a recursive delete would
/// otherwise stop at them, or empty a mount another process still sees).
pub fn remove_pod_dir(dir: &Path) -> std::io::Result<()> {
    // Mounts of these directories in the runtime's namespace, if it is another one, go with
    // the directories: rmdir detaches a mount point's mounts in other namespaces.
    for m in mounts_under(dir) {
        unmount(&m);
    }
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The prefix of the service-account token volume the apiserver's ServiceAccount admission
/// adds to every pod, with a random suffix.
pub const TOKEN_VOLUME_PREFIX: &str = "kube-api-access-";

/// After delete-and-adopt: the replacement pod's token volume has a new random name, while
/// the adopted containers mount the replaced pod's. `new_name` (in `volume_dir/projected`)
/// becomes a symlink to the one other token volume there, so the renewed token the runtime
/// writes for the replacement lands in the directory the containers see. (The directory is
/// a tmpfs mount point, which cannot be renamed.) Returns whether a link was made; nothing
/// is done when `new_name` exists or the old volume is not exactly one.
pub fn link_adopted_token_volume(volume_dir: &Path, new_name: &str) -> std::io::Result<bool> {
    let projected = volume_dir.join("projected");
    // The name comes from the cached pod: a DNS-1123 label, or no link (`..` would put it
    // outside the pod's directory).
    if !new_name.starts_with(TOKEN_VOLUME_PREFIX)
        || crate::names::check_label(new_name).is_err()
        || std::fs::symlink_metadata(projected.join(new_name)).is_ok()
    {
        return Ok(false);
    }
    let old: Vec<String> = match std::fs::read_dir(&projected) {
        Ok(rd) => rd
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(TOKEN_VOLUME_PREFIX))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let [old] = old.as_slice() else {
        return Ok(false);
    };
    std::os::unix::fs::symlink(old, projected.join(new_name))?;
    Ok(true)
}

fn check_host_path(name: &str, path: &Path, kind: &str) -> Result<(), Unsupported> {
    let meta = std::fs::metadata(path);
    let ok = match (kind, &meta) {
        ("", _) => true,
        ("DirectoryOrCreate", Err(_)) => {
            mkdir(path, 0o755)
                .map_err(|e| fail(name, format!("cannot create {}: {e}", path.display())))?;
            true
        }
        ("FileOrCreate", Err(_)) => {
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| fail(name, format!("cannot create {}: {e}", path.display())))?;
            true
        }
        ("DirectoryOrCreate" | "Directory", Ok(m)) => m.is_dir(),
        ("FileOrCreate" | "File", Ok(m)) => m.is_file(),
        ("Socket", Ok(m)) => m.file_type().is_socket(),
        ("CharDevice", Ok(m)) => m.file_type().is_char_device(),
        ("BlockDevice", Ok(m)) => m.file_type().is_block_device(),
        _ => false,
    };
    if !ok {
        return Err(fail(
            name,
            format!("hostPath {} is not a {kind}", path.display()),
        ));
    }
    Ok(())
}

/// Whether `dir/..data` already holds exactly `files` (contents, modes, nothing else).
fn unchanged(dir: &Path, files: &[VolumeFile]) -> bool {
    let data = dir.join(DATA);
    let mut want = BTreeSet::new();
    for f in files {
        let p = data.join(&f.path);
        let same = std::fs::symlink_metadata(&p)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o7777 == f.mode)
            && std::fs::read(&p).is_ok_and(|b| b == f.data);
        if !same {
            return false;
        }
        want.insert(PathBuf::from(&f.path));
    }
    let mut have = BTreeSet::new();
    if list_files(&data, Path::new(""), &mut have).is_err() {
        return false;
    }
    have == want
}

fn list_files(root: &Path, rel: &Path, out: &mut BTreeSet<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(root.join(rel))? {
        let e = e?;
        let r = rel.join(e.file_name());
        if e.file_type()?.is_dir() {
            list_files(root, &r, out)?;
        } else {
            out.insert(r);
        }
    }
    Ok(())
}

/// Writes a file volume atomically; returns whether anything changed.
pub fn write_files(dir: &Path, files: &[VolumeFile]) -> std::io::Result<bool> {
    mkdir(dir, 0o755)?;
    if unchanged(dir, files) {
        return Ok(false);
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let version = format!("..{stamp}");
    let vdir = dir.join(&version);
    mkdir(&vdir, 0o755)?;
    // 0755 regardless of umask, so a container running as another user can read.
    std::fs::set_permissions(&vdir, std::fs::Permissions::from_mode(0o755))?;
    for f in files {
        let p = vdir.join(&f.path);
        if let Some(parent) = p.parent() {
            mkdir(parent, 0o755)?;
        }
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(f.mode)
            .open(&p)?;
        out.write_all(&f.data)?;
        out.sync_all()?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(f.mode))?;
    }
    // Swap `..data` in one rename.
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&version, &tmp)?;
    std::fs::rename(&tmp, dir.join(DATA))?;
    // Stable top-level names, and none for what is gone.
    let top: BTreeSet<String> = files
        .iter()
        .filter_map(|f| f.path.split('/').next().map(str::to_string))
        .collect();
    for t in &top {
        let link = dir.join(t);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new(DATA).join(t), &link)?;
        }
    }
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("..") {
            if name != DATA && name != version && e.file_type()?.is_dir() {
                std::fs::remove_dir_all(e.path())?;
            }
        } else if !top.contains(&name) && e.file_type()?.is_symlink() {
            std::fs::remove_file(e.path())?;
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, data: &str, mode: u32) -> VolumeFile {
        VolumeFile {
            path: path.into(),
            data: data.as_bytes().to_vec(),
            mode,
        }
    }

    #[test]
    fn writes_swaps_and_skips_unchanged_payloads() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cfg");
        let v1 = vec![
            file("app.conf", "level=info\n", 0o644),
            file("sub/x", "1", 0o600),
        ];
        assert!(write_files(&dir, &v1).unwrap());
        assert_eq!(
            std::fs::read_to_string(dir.join("app.conf")).unwrap(),
            "level=info\n"
        );
        assert_eq!(std::fs::read_to_string(dir.join("sub/x")).unwrap(), "1");
        let mode = std::fs::metadata(dir.join("sub/x"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let target = std::fs::read_link(dir.join(DATA)).unwrap();

        // Same payload: nothing written, same version directory.
        assert!(!write_files(&dir, &v1).unwrap());
        assert_eq!(std::fs::read_link(dir.join(DATA)).unwrap(), target);

        // New payload: new version, old one gone, dropped key's link gone.
        let v2 = vec![file("app.conf", "level=debug\n", 0o644)];
        assert!(write_files(&dir, &v2).unwrap());
        assert_ne!(std::fs::read_link(dir.join(DATA)).unwrap(), target);
        assert_eq!(
            std::fs::read_to_string(dir.join("app.conf")).unwrap(),
            "level=debug\n"
        );
        assert!(std::fs::symlink_metadata(dir.join("sub")).is_err());
        let versions = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                let n = n.to_string_lossy();
                n.starts_with("..") && n != DATA
            })
            .count();
        assert_eq!(versions, 1);

        // A mode change alone is a change.
        let v3 = vec![file("app.conf", "level=debug\n", 0o640)];
        assert!(write_files(&dir, &v3).unwrap());
    }

    #[test]
    fn an_adopted_token_volume_is_linked_to_the_mounted_one() {
        let dir = tempfile::tempdir().unwrap();
        let projected = dir.path().join("projected");
        assert!(!link_adopted_token_volume(dir.path(), "kube-api-access-new").unwrap());
        std::fs::create_dir_all(projected.join("kube-api-access-old")).unwrap();
        std::fs::create_dir_all(projected.join("other")).unwrap();
        assert!(!link_adopted_token_volume(dir.path(), "other-new").unwrap());
        // A name from the cached pod that climbs out of the pod's directory links nothing.
        assert!(!link_adopted_token_volume(dir.path(), "kube-api-access-/../../escape").unwrap());
        assert!(!dir.path().parent().unwrap().join("escape").exists());
        assert!(link_adopted_token_volume(dir.path(), "kube-api-access-new").unwrap());
        assert!(
            !link_adopted_token_volume(dir.path(), "kube-api-access-new").unwrap(),
            "once"
        );
        std::fs::write(projected.join("kube-api-access-new/token"), "t2").unwrap();
        assert_eq!(
            std::fs::read_to_string(projected.join("kube-api-access-old/token")).unwrap(),
            "t2",
            "written through to the mounted directory"
        );
        // Two candidates: which one is ambiguous; nothing is linked.
        std::fs::create_dir_all(projected.join("kube-api-access-x")).unwrap();
        assert!(!link_adopted_token_volume(dir.path(), "kube-api-access-y").unwrap());
    }

    #[test]
    fn an_empty_volume_is_an_empty_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("opt");
        assert!(write_files(&dir, &[]).unwrap());
        assert!(!write_files(&dir, &[]).unwrap());
        assert!(dir.join(DATA).is_dir());
    }
}
