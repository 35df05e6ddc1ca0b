use super::*;
use std::time::Duration;

fn resolve(
    file: Option<&str>,
    env: &[(&str, &str)],
    flags: &Overrides,
) -> Result<Config, ConfigError> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::resolve(
        file,
        Path::new("/etc/edgehub/config.toml"),
        &env,
        flags,
        Some("edge-1".into()),
    )
}

fn field_of(e: ConfigError) -> String {
    match e {
        ConfigError::Invalid { field, .. } => field,
        other => panic!("expected Invalid, got {other}"),
    }
}

#[test]
fn defaults_suit_a_device() {
    let c = resolve(None, &[], &Overrides::default()).unwrap();
    assert_eq!(c.node_name, "edge-1");
    assert_eq!(c.data_dir, Path::new("/var/lib/edgehub"));
    assert_eq!(c.db_path(), Path::new("/var/lib/edgehub/edgehub.db"));
    assert_eq!(c.kubeconfig, Path::new("/etc/edgehub/kubeconfig"));
    assert_eq!(c.api_addr, Some("127.0.0.1:10267".parse().unwrap()));
    assert_eq!(c.cri_socket, Path::new("/run/containerd/containerd.sock"));
    assert!(c.sync.watch_namespaces.is_empty());
    assert_eq!(c.sync.list_page_size, 100);
}

#[test]
fn flags_beat_env_beat_file() {
    let file = "node_name = \"from-file\"\ndata_dir = \"/file\"\napi_addr = \"127.0.0.1:1\"\n";
    let env = [
        ("EDGEHUB_NODE_NAME", "from-env"),
        ("EDGEHUB_DATA_DIR", "/env"),
    ];
    let flags = Overrides {
        node_name: Some("from-flag".into()),
        ..Default::default()
    };
    let c = resolve(Some(file), &env, &flags).unwrap();
    assert_eq!(c.node_name, "from-flag");
    assert_eq!(c.data_dir, Path::new("/env"));
    assert_eq!(c.api_addr, Some("127.0.0.1:1".parse().unwrap()));
}

#[test]
fn sync_section_is_read() {
    let file =
        "[sync]\nwatch_namespaces = [\"vehicle\"]\nbackoff_max_secs = 5\nlist_page_size = 7\n";
    let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
    assert_eq!(c.sync.watch_namespaces, ["vehicle"]);
    assert_eq!(c.sync.backoff_max, Duration::from_secs(5));
    assert_eq!(c.sync.list_page_size, 7);
}

#[test]
fn invalid_values_name_the_field() {
    let cases: &[(&str, &str)] = &[
        ("node_name = \"Edge_1\"", "node_name"),
        ("data_dir = \"relative/dir\"", "data_dir"),
        ("api_addr = \"localhost\"", "api_addr"),
        ("cri_socket = \"containerd.sock\"", "cri_socket"),
        ("log = \"info,,=[\"", "log"),
        (
            "[sync]\nwatch_namespaces = [\"Bad NS\"]",
            "sync.watch_namespaces",
        ),
        ("[sync]\nbackoff_max_secs = 0", "sync.backoff_max_secs"),
        (
            "[sync]\nbackoff_initial_ms = 9000\nbackoff_max_secs = 1",
            "sync.backoff_initial_ms",
        ),
        ("[sync]\nmax_event_bytes = 10", "sync.max_event_bytes"),
        ("[sync]\nlist_page_size = 0", "sync.list_page_size"),
        ("[api]\nsocket = \"rel.sock\"", "api.socket"),
        ("[api]\nsocket_mode = \"999\"", "api.socket_mode"),
        ("[api]\nsocket_mode = \"01777\"", "api.socket_mode"),
        ("[api]\ntoken_file = \"token\"", "api.token_file"),
        ("[api]\nsocket_group = \"a:b\"", "api.socket_group"),
    ];
    for (file, field) in cases {
        let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), *field, "{file}: {msg}");
    }
}

#[test]
fn unknown_and_mistyped_keys_are_parse_errors() {
    for file in [
        "nodename = \"x\"",
        "[sync]\nlist_page_size = \"ten\"",
        "this is = not toml [",
    ] {
        let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }), "{file}: {e}");
        assert!(e.to_string().contains("/etc/edgehub/config.toml"));
    }
}

#[test]
fn bad_hostname_asks_for_node_name() {
    let e = Config::resolve(
        None,
        Path::new("x"),
        &[],
        &Overrides::default(),
        Some("My_Laptop".into()),
    )
    .unwrap_err();
    assert!(e.to_string().contains("set node_name"), "{e}");
    let e = Config::resolve(None, Path::new("x"), &[], &Overrides::default(), None).unwrap_err();
    assert_eq!(field_of(e), "node_name");
}

#[test]
fn node_section_is_read_and_checked() {
    let file = "[node]\nmax_pods = 32\nlabels = { \"openyurt.io/is-edge-worker\" = \"true\", \"node.kubernetes.io/instance-type\" = \"vehicle-ecu\" }\ntaints = [{ key = \"edge\", value = \"true\", effect = \"NoSchedule\" }]\n";
    let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
    assert_eq!(c.node.max_pods, 32);
    assert_eq!(c.node.labels.len(), 2);
    assert_eq!(c.node.taints[0].effect, "NoSchedule");
    let d = resolve(None, &[], &Overrides::default()).unwrap().node;
    assert_eq!(
        (d.max_pods, d.lease_renew, d.lease_duration_secs),
        (110, Duration::from_secs(10), 40)
    );
    assert_eq!(d.status_report, Duration::from_secs(300));

    for (file, field, why) in [
        (
            "[node]\nlabels = { \"node-role.kubernetes.io/edge\" = \"\" }",
            "node.labels",
            "node-role.kubernetes.io",
        ),
        (
            "[node]\nlabels = { \"kubernetes.io/custom\" = \"x\" }",
            "node.labels",
            "NodeRestriction",
        ),
        ("[node]\nlabels = { \"a/b/c\" = \"x\" }", "node.labels", ""),
        (
            "[node]\nlabels = { \"ok\" = \"bad value!\" }",
            "node.labels",
            "",
        ),
        (
            "[node]\ntaints = [{ key = \"k\", effect = \"Sometimes\" }]",
            "node.taints",
            "NoSchedule",
        ),
        ("[node]\nlease_renew_secs = 40", "node.lease_renew_secs", ""),
        ("[node]\nmax_pods = 0", "node.max_pods", ""),
        (
            "[node]\ndisk_pressure_percent = 101",
            "node.disk_pressure_percent",
            "",
        ),
    ] {
        let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), field, "{file}");
        assert!(msg.contains(why), "{msg}");
    }
    for ok in [
        "kubernetes.io/hostname",
        "node.kubernetes.io/instance-type",
        "kubelet.kubernetes.io/x",
        "example.com/team",
        "plain",
    ] {
        assert!(check_node_label(ok, "v").is_ok(), "{ok}");
    }
}

#[test]
fn tcp_can_be_turned_off_when_the_socket_is_set() {
    let c = resolve(
        Some("api_addr = \"none\"\n[api]\nsocket = \"/run/edgehub/api.sock\"\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.api_addr, None);
    let flag = Overrides {
        api_addr: Some("none".into()),
        ..Default::default()
    };
    assert_eq!(
        field_of(resolve(None, &[], &flag).unwrap_err()),
        "api_addr",
        "no socket: nothing could reach the API"
    );
}

#[test]
fn seal_section_is_read_and_checked() {
    let c = resolve(
        Some("[seal]\nkey_file = \"/mnt/protected/edgehub.key\"\ncredential = \"k\"\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(
        c.seal.key_file.as_deref(),
        Some(Path::new("/mnt/protected/edgehub.key"))
    );
    assert_eq!(c.seal.credential.as_deref(), Some("k"));
    assert_eq!(
        resolve(None, &[], &Overrides::default()).unwrap().seal,
        SealConfig::default()
    );
    for bad in [
        "[seal]\nkey_file = \"rel.key\"",
        "[seal]\ncredential = \"a/b\"",
        "[seal]\ncredential = \"\"",
    ] {
        let f = field_of(resolve(Some(bad), &[], &Overrides::default()).unwrap_err());
        assert!(f.starts_with("seal."), "{bad}: {f}");
    }
}

#[test]
fn api_section_is_read() {
    let file = "[api]\nsocket = \"/run/edgehub/api.sock\"\nsocket_mode = \"0600\"\nsocket_group = \"ota\"\ntoken_file = \"/etc/edgehub/api-token\"\n";
    let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
    assert_eq!(
        c.api.socket.as_deref(),
        Some(Path::new("/run/edgehub/api.sock"))
    );
    assert_eq!(c.api.socket_mode, 0o600);
    assert_eq!(c.api.socket_group.as_deref(), Some("ota"));
    assert_eq!(
        c.api.token_file.as_deref(),
        Some(Path::new("/etc/edgehub/api-token"))
    );
    let d = resolve(None, &[], &Overrides::default()).unwrap();
    assert_eq!(
        d.api,
        ApiConfig {
            socket_mode: 0o660,
            ..Default::default()
        }
    );
}

#[test]
fn mistyped_log_filters_are_refused() {
    for bad in [
        "warning",
        "verbose",
        "info ",
        " info",
        "",
        "  ",
        "edgehub",
        "edgehub=verbose",
        "info,",
        "=debug",
        "edgehub::sync=",
    ] {
        let e = resolve(Some(&format!("log = {bad:?}")), &[], &Overrides::default()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), "log", "{bad:?}: {msg}");
    }
    // From the environment and the flag too: an empty EDGEHUB_LOG is not "the default".
    let e = resolve(None, &[("EDGEHUB_LOG", "")], &Overrides::default()).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let flags = Overrides {
        log: Some("warning".into()),
        ..Default::default()
    };
    let e = resolve(None, &[], &flags).unwrap_err();
    assert!(
        e.to_string().contains("\"warning\" is not a log level"),
        "{e}"
    );
    for good in [
        "info",
        "WARN",
        "off",
        "3",
        "info,edgehub::sync=debug",
        "edgehub=trace,hyper=warn",
        "warn,edgehub::runtime[pass]=debug",
    ] {
        let c = resolve(Some(&format!("log = {good:?}")), &[], &Overrides::default());
        assert!(c.is_ok(), "{good:?}: {:?}", c.err());
    }
}

#[test]
fn every_numeric_field_is_bounded() {
    // Each of these was wrapped or clamped without a word before.
    for (file, field) in [
        (
            "[node]\nmemory_reserve_mib = 17592186044416",
            "node.memory_reserve_mib",
        ),
        (
            "[node]\nmemory_pressure_mib = 17592186044416",
            "node.memory_pressure_mib",
        ),
        (
            "[upgrade]\nmin_ready_floor_secs = 86400",
            "upgrade.min_ready_floor_secs",
        ),
        (
            "[report]\nreconnect_jitter_secs = 86400",
            "report.reconnect_jitter_secs",
        ),
        ("[report]\nmax_rate = 1000000", "report.max_rate"),
        ("[node]\nstatus_report_secs = 0", "node.status_report_secs"),
        (
            "[node]\nstatus_report_secs = 9999999",
            "node.status_report_secs",
        ),
        (
            "[node]\nlease_duration_secs = 99999",
            "node.lease_duration_secs",
        ),
        ("[node]\nlease_renew_secs = 0", "node.lease_renew_secs"),
        ("[logs]\nmax_size_kib = 1", "logs.max_size_kib"),
        ("[logs]\nmax_files = 1", "logs.max_files"),
        (
            "[logs]\nmonitor_interval_secs = 0",
            "logs.monitor_interval_secs",
        ),
    ] {
        let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), field, "{file}: {msg}");
        assert!(msg.contains("must be between"), "{msg}");
    }
    let d = resolve(None, &[], &Overrides::default()).unwrap();
    assert_eq!(d.node.memory_reserve_bytes, 256 << 20);
    assert_eq!(d.upgrade.min_ready_floor, Duration::from_secs(2));
    assert_eq!(d.report.reconnect_jitter, Duration::from_secs(30));
    assert_eq!(
        d.logs,
        LogsConfig {
            max_size_bytes: 10 << 20,
            max_files: 5,
            monitor_interval: Duration::from_secs(10),
        }
    );
    // The edges are allowed.
    let c = resolve(
        Some("[node]\nmemory_reserve_mib = 1048576\n[upgrade]\nmin_ready_floor_secs = 0\n[report]\nreconnect_jitter_secs = 0\n[logs]\nmax_size_kib = 16\nmax_files = 2\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.node.memory_reserve_bytes, 1 << 40);
    assert_eq!((c.logs.max_size_bytes, c.logs.max_files), (16 << 10, 2));
}

#[test]
fn env_overrides_apply() {
    let env = [
        ("EDGEHUB_KUBECONFIG", "/k"),
        ("EDGEHUB_API_ADDR", "0.0.0.0:9"),
        ("EDGEHUB_CRI_SOCKET", "/run/x.sock"),
        ("EDGEHUB_LOG", "debug"),
    ];
    let c = resolve(None, &env, &Overrides::default()).unwrap();
    assert_eq!(c.kubeconfig, Path::new("/k"));
    assert_eq!(c.api_addr, Some("0.0.0.0:9".parse().unwrap()));
    assert_eq!(c.cri_socket, Path::new("/run/x.sock"));
    assert_eq!(c.log, "debug");
}

#[test]
fn the_factory_key_and_chain_files_go_together_and_are_absolute() {
    let file = "[identity]\nbootstrap_kubeconfig = \"/etc/edgehub/bootstrap-kubeconfig\"\nfactory_key_file = \"/etc/edgehub/factory/key.pem\"\nfactory_cert_file = \"/etc/edgehub/factory/chain.pem\"\n";
    let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
    assert_eq!(
        c.identity.factory_key_file.as_deref(),
        Some(Path::new("/etc/edgehub/factory/key.pem"))
    );
    assert_eq!(
        c.identity.factory_cert_file.as_deref(),
        Some(Path::new("/etc/edgehub/factory/chain.pem"))
    );
    for (file, field) in [
        (
            "[identity]\nfactory_key_file = \"/k.pem\"",
            "identity.factory_key_file",
        ),
        (
            "[identity]\nfactory_cert_file = \"/c.pem\"",
            "identity.factory_key_file",
        ),
        (
            "[identity]\nfactory_key_file = \"k.pem\"\nfactory_cert_file = \"/c.pem\"",
            "identity.factory_key_file",
        ),
        (
            "[identity]\nfactory_key_file = \"/k.pem\"\nfactory_cert_file = \"c.pem\"",
            "identity.factory_cert_file",
        ),
        // Without TLS bootstrap there is no CSR to sign.
        (
            "[identity]\nfactory_key_file = \"/k.pem\"\nfactory_cert_file = \"/c.pem\"",
            "identity.factory_key_file",
        ),
    ] {
        let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
        let msg = e.to_string();
        assert_eq!(field_of(e), field, "{file}: {msg}");
    }
}

#[test]
fn the_node_name_can_come_from_a_firmware_file() {
    let read = |p: &Path| -> std::io::Result<String> {
        match p.to_str() {
            Some("/run/firmware/vin") => Ok("1HGCM82633A004352\n".into()),
            Some("/run/firmware/bad") => Ok("not a name!".into()),
            _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    };
    let go = |text: &str, flags: &Overrides| {
        Config::resolve_reading(
            Some(text),
            Path::new("c.toml"),
            &[],
            flags,
            Some("host-1".into()),
            &read,
        )
    };
    let file = "[identity]\nnode_name_file = \"/run/firmware/vin\"\n";
    assert_eq!(
        go(file, &Overrides::default()).unwrap().node_name,
        "1hgcm82633a004352"
    );
    // The config's own node_name and the flag win over the file.
    let named = format!("node_name = \"edge-7\"\n{file}");
    assert_eq!(
        go(&named, &Overrides::default()).unwrap().node_name,
        "edge-7"
    );
    let flags = Overrides {
        node_name: Some("edge-9".into()),
        ..Default::default()
    };
    assert_eq!(go(file, &flags).unwrap().node_name, "edge-9");
    for (text, want) in [
        (
            "[identity]\nnode_name_file = \"/run/firmware/bad\"\n",
            "is not a valid node name",
        ),
        (
            "[identity]\nnode_name_file = \"/run/firmware/none\"\n",
            "/run/firmware/none",
        ),
        (
            "[identity]\nnode_name_file = \"relative\"\n",
            "identity.node_name_file",
        ),
    ] {
        let e = go(text, &Overrides::default()).unwrap_err().to_string();
        assert!(
            e.contains(want) && e.contains("identity.node_name_file"),
            "{e}"
        );
    }
}

#[test]
fn image_gc_thresholds_are_read_and_checked() {
    let d = resolve(None, &[], &Overrides::default()).unwrap();
    assert_eq!(d.images.gc, crate::images::gc::GcPolicy::default());
    assert_eq!(d.images.gc_interval, Duration::from_secs(60));
    let c = resolve(
        Some("[images]\ngc_keep_previous = false\ngc_high_percent = 90\ngc_low_percent = 70\ngc_interval_secs = 5\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert!(!c.images.gc.keep_previous);
    assert_eq!(
        (c.images.gc.high_percent, c.images.gc.low_percent),
        (90, 70)
    );
    assert_eq!(c.images.gc_interval, Duration::from_secs(5));
    for bad in [
        "gc_high_percent = 101",
        "gc_high_percent = 0",
        "gc_low_percent = 85",
        "gc_high_percent = 70\ngc_low_percent = 75",
        "gc_interval_secs = 0",
    ] {
        let e = resolve(
            Some(&format!("[images]\n{bad}\n")),
            &[],
            &Overrides::default(),
        )
        .unwrap_err();
        assert!(field_of(e).starts_with("images.gc_"), "{bad}");
    }
}

#[test]
fn the_node_api_is_off_unless_an_address_is_given() {
    let c = resolve(None, &[], &Overrides::default()).unwrap();
    assert_eq!(c.node_api.addr, None);
    assert_eq!(c.node.kubelet_port, None);
    let c = resolve(
        Some("[node]\nnode_api_addr = \"\"\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.node_api.addr, None);
    // An IP alone: the kubelet's port, advertised by the Node.
    let c = resolve(
        Some("[node]\nnode_api_addr = \"0.0.0.0\"\nnode_api_client_ca_file = \"/etc/edgehub/client-ca.crt\"\nnode_api_max_streams = 2\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.node_api.addr, Some("0.0.0.0:10250".parse().unwrap()));
    assert_eq!(c.node.kubelet_port, Some(10250));
    assert_eq!(
        c.node_api.client_ca_file.as_deref(),
        Some(Path::new("/etc/edgehub/client-ca.crt"))
    );
    assert_eq!(c.node_api.max_streams, 2);
    assert!(!c.node_api.self_signed);
    let c = resolve(
        Some("[node]\nnode_api_addr = \"10.0.2.15:11250\"\nnode_api_self_signed = true\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.node.kubelet_port, Some(11250));
    assert!(c.node_api.self_signed);
    assert_eq!(c.node_api.handshake_timeout, Duration::from_secs(10));
    assert_eq!(c.node_api.max_unauthenticated, 16);
    let c = resolve(
        Some("[node]\nnode_api_handshake_timeout_secs = 3\nnode_api_max_unauthenticated_connections = 4\n"),
        &[],
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(c.node_api.handshake_timeout, Duration::from_secs(3));
    assert_eq!(c.node_api.max_unauthenticated, 4);
    for (bad, field) in [
        (
            "node_api_handshake_timeout_secs = 0",
            "node.node_api_handshake_timeout_secs",
        ),
        (
            "node_api_max_unauthenticated_connections = 0",
            "node.node_api_max_unauthenticated_connections",
        ),
        ("node_api_addr = \"edge-1\"", "node.node_api_addr"),
        (
            "node_api_client_ca_file = \"ca.crt\"",
            "node.node_api_client_ca_file",
        ),
        ("node_api_max_streams = 0", "node.node_api_max_streams"),
        (
            "node_api_idle_timeout_secs = 0",
            "node.node_api_idle_timeout_secs",
        ),
    ] {
        let e = resolve(
            Some(&format!("[node]\n{bad}\n")),
            &[],
            &Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(field_of(e), field, "{bad}");
    }
}
