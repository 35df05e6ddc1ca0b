//! What edgehub keeps on the device's flash, and who can read it: the modes of the files and
//! directories of its data dir, on real files.

use edgehub::store::{OpenMode, Store};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn with_suffix(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// A data dir as a crash leaves it after someone with umask 022 touched it (a `sqlite3`
/// session, a restore from a backup): the directory 0755, the database, its WAL and its
/// shared-memory index 0644. Reopened, edgehub makes every one of them its own again before
/// it writes a byte, and the files SQLite creates afterwards are 0600 too.
#[test]
fn a_reopened_data_dir_is_0700_and_every_store_file_0600() {
    let tmp = tempfile::tempdir().unwrap();
    let live = tmp.path().join("live/edgehub.db");
    let store = Store::open(&live, OpenMode::Normal).unwrap();
    store.set_cursor("pods?fieldSelector=x", "1").unwrap();
    // The crash image: the files as they are while the store is open (the WAL holds the
    // commit; SQLite removes it at a clean close).
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let db = data.join("edgehub.db");
    for suffix in ["", "-wal", "-shm"] {
        let from = with_suffix(&live, suffix);
        assert!(from.exists(), "{} exists while open", from.display());
        std::fs::copy(&from, with_suffix(&db, suffix)).unwrap();
    }
    drop(store);
    for p in [
        db.clone(),
        with_suffix(&db, "-wal"),
        with_suffix(&db, "-shm"),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();

    let store = Store::open(&db, OpenMode::Normal).unwrap();
    assert_eq!(
        store.cursor("pods?fieldSelector=x").unwrap().as_deref(),
        Some("1"),
        "the crash image's commit survived"
    );
    assert_eq!(mode(&data), 0o700, "the data dir");
    for suffix in ["", "-wal", "-shm"] {
        let p = with_suffix(&db, suffix);
        if p.exists() {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
        }
    }
    // What SQLite creates from here on: a WAL after a clean close, written again.
    drop(store);
    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.set_cursor("pods?fieldSelector=x", "2").unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let p = with_suffix(&db, suffix);
        assert!(p.exists(), "{} exists while open", p.display());
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
}
