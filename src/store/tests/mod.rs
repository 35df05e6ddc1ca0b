use super::*;
use crate::object::Kind;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

fn pod(name: &str, rv: &str) -> StoredObject {
    let raw = format!(
        r#"{{"metadata":{{"name":"{name}","namespace":"ns","uid":"uid-{name}","resourceVersion":"{rv}"}}}}"#
    );
    StoredObject::from_raw(Kind::Pod, raw).unwrap()
}

fn db() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/edgehub.db");
    (dir, path)
}

mod cache;
mod file;
mod history;
mod transactions;
