//! A containerd of a test's own on a small tmpfs root, for the tests that fill its image
//! filesystem (image GC under pressure, the import's space check). Needs root.
#![allow(dead_code)]

use edgehub::cri::CriRuntime;
use std::process::Command;

/// A containerd of the test's own whose root is a 64 MiB tmpfs, so its image filesystem can be
/// filled; killed and unmounted on drop, whatever the test did.
pub struct SmallContainerd {
    child: std::process::Child,
    /// containerd's root, the tmpfs.
    pub root: std::path::PathBuf,
    pub socket: std::path::PathBuf,
    config: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallContainerd {
    pub async fn start() -> SmallContainerd {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(&root).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
            .arg(&root)
            .status()
            .expect("mount runs");
        assert!(st.success(), "mounting a tmpfs needs root");
        let socket = dir.path().join("containerd.sock");
        // The shared stack's registry hosts (plain HTTP on loopback).
        let certs = crate::common::cri_stack().parent().unwrap().join("certs.d");
        let config = dir.path().join("config.toml");
        let d = dir.path().display();
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{}\"\nstate = \"{d}/state\"\n\
                 [grpc]\n  address = \"{}\"\n[ttrpc]\n  address = \"{}.ttrpc\"\n\
                 [debug]\n  address = \"{d}/debug.sock\"\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{d}/opt\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"127.0.0.1:5000/pause:1.0\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".registry]\n    config_path = \"{}\"\n",
                root.display(),
                socket.display(),
                socket.display(),
                certs.display()
            ),
        )
        .unwrap();
        let child = spawn(&config);
        let c = SmallContainerd {
            child,
            root,
            socket,
            config,
            _dir: dir,
        };
        c.answers().await;
        c
    }

    /// Waits until the CRI answers on the socket.
    async fn answers(&self) {
        let cri = edgehub::cri::CriClient::new(&self.socket);
        crate::common::wait_until(30, "the small containerd answers", || self.socket.exists())
            .await;
        for _ in 0..300 {
            if cri.version().await.is_ok() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("the small containerd never answered");
    }

    /// Stops containerd (its root and state stay), as a crash or an update would.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the stopped containerd again on the same root, and waits until it answers.
    pub async fn start_again(&mut self) {
        self.child = spawn(&self.config);
        self.answers().await;
    }
}

/// containerd with `config`, its output appended to `containerd.log` beside it.
fn spawn(config: &std::path::Path) -> std::process::Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(config.with_file_name("containerd.log"))
        .unwrap();
    Command::new("containerd")
        .arg("--config")
        .arg(config)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("containerd is installed (scripts/setup.sh)")
}

impl Drop for SmallContainerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.root).status();
    }
}
