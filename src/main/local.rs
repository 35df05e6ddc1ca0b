//! The commands that ask the local API of a running edgehub: `pods`, `status`, `images`,
//! `logs`, `upgrade`, each printing what it answered.

use anyhow::Context;
use edgehub::api::{self, listen};
use edgehub::local_client::{self as local, LocalClient};

use super::{load_config, Cli};

/// A client for this node's local API, from the same configuration `edgehub run` uses.
pub(crate) fn local_client(cli: &Cli) -> anyhow::Result<LocalClient> {
    let config = load_config(cli)?;
    Ok(LocalClient::for_config(
        &config,
        listen::read_token(&config.api)?,
        std::time::Duration::from_secs(30),
    ))
}

/// The same, for a privileged route: over the unix socket when one is configured.
pub(crate) fn privileged_client(cli: &Cli) -> anyhow::Result<LocalClient> {
    let config = load_config(cli)?;
    Ok(LocalClient::privileged_for_config(
        &config,
        listen::read_token(&config.api)?,
        std::time::Duration::from_secs(30),
    ))
}

/// The error of a privileged command's 403: the API's words and what to do.
pub(crate) fn forbidden(what: &str, a: &local::Answer, c: &LocalClient) -> anyhow::Error {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    anyhow::anyhow!(local::forbidden(what, &a.body, &c.target, euid))
}

pub fn pods(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/pods")?;
    if a.status != 200 {
        anyhow::bail!("GET /pods: {} {}", a.status, a.body.trim());
    }
    print!(
        "{}",
        local::pods_table(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

pub fn status(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/v1/status")?;
    if a.status != 200 {
        anyhow::bail!("GET /v1/status: {} {}", a.status, a.body.trim());
    }
    print!(
        "{}",
        local::status_text(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

/// `edgehub bootstrap --token-file F|-`: the token, read and handed to the running edgehub.
pub fn bootstrap(cli: &Cli, token_file: &str) -> anyhow::Result<()> {
    let mut token = String::new();
    if token_file == "-" {
        use std::io::Read;
        std::io::stdin()
            .read_to_string(&mut token)
            .context("cannot read the token from standard input")?;
    } else {
        token = std::fs::read_to_string(token_file)
            .with_context(|| format!("cannot read {token_file}"))?;
    }
    let client = privileged_client(cli)?;
    let a = client.put("/v1/bootstrap-token", token.trim().as_bytes())?;
    if a.status == 403 {
        return Err(forbidden("edgehub bootstrap", &a, &client));
    }
    if a.status != 202 {
        anyhow::bail!("PUT /v1/bootstrap-token: {} {}", a.status, a.body.trim());
    }
    println!("{}", a.body.trim());
    Ok(())
}

pub fn images_list(cli: &Cli) -> anyhow::Result<()> {
    let a = local_client(cli)?.get("/v1/images")?;
    if a.status != 200 {
        anyhow::bail!("{} ({})", a.body.trim(), a.status);
    }
    print!(
        "{}",
        local::images_table(&a.body).map_err(anyhow::Error::msg)?
    );
    Ok(())
}

pub fn images_load(cli: &Cli, file: &str, force: bool) -> anyhow::Result<()> {
    let mut headers = Vec::new();
    let (reader, len): (Box<dyn std::io::Read + Send>, Option<u64>) = if file == "-" {
        (Box::new(std::io::stdin()), None)
    } else {
        let mut f = std::fs::File::open(file).with_context(|| format!("cannot open {file}"))?;
        let len = f.metadata().ok().map(|m| m.len());
        if let Some(h) = declaration(&mut f) {
            headers.push((edgehub::images::declare::HEADER, h));
        }
        std::io::Seek::rewind(&mut f).with_context(|| format!("cannot read {file}"))?;
        (Box::new(f), len)
    };
    let path = if force {
        "/v1/images/load?force=true"
    } else {
        "/v1/images/load"
    };
    let client = privileged_client(cli)?;
    let a = client.upload(path, reader, len, &headers)?;
    if a.status == 403 && a.body.starts_with("Forbidden: ") {
        // The access class's refusal (the image policy's 403 says which image and why).
        return Err(forbidden("edgehub images load", &a, &client));
    }
    if a.status != 200 {
        anyhow::bail!("{} ({})", a.body.trim(), a.status);
    }
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap_or_default();
    for name in v["images"].as_array().into_iter().flatten() {
        println!("loaded {}", name.as_str().unwrap_or_default());
    }
    Ok(())
}

/// The `Edgehub-Blobs` declaration of an archive file, from its tar headers, so edgehub checks
/// free space before it writes anything; `None` when the file cannot be scanned (edgehub's
/// import then says what is wrong with it) or the header would be too long (edgehub bounds
/// a plain archive by its length instead).
fn declaration(f: &mut std::fs::File) -> Option<String> {
    use edgehub::images::{declare, scan};
    let scanned = scan::scan(f).ok()?;
    declare::header(&declare::from_scan(&scanned))
}

pub fn logs(cli: &Cli, pod: &str, req: &local::LogsRequest<'_>) -> anyhow::Result<()> {
    let path = local::logs_path(pod, req).map_err(anyhow::Error::msg)?;
    let header = |h: &hyper::HeaderMap, name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut on_head = |h: &hyper::HeaderMap| {
        let notice = local::defaulted_notice(
            header(h, api::CONTAINER_HEADER).as_deref(),
            header(h, api::CONTAINERS_HEADER).as_deref(),
        );
        if let Some(n) = notice {
            eprintln!("{n}");
        }
    };
    let refused =
        local_client(cli)?.get_streaming(&path, &mut on_head, &mut std::io::stdout().lock())?;
    if let Some(a) = refused {
        anyhow::bail!("{} {}", a.status, a.body.trim());
    }
    Ok(())
}

pub fn upgrade(
    cli: &Cli,
    pods: &[String],
    wait: bool,
    timeout: Option<&str>,
) -> anyhow::Result<()> {
    let pod = match pods {
        [one] if !one.contains('@') => one.as_str(),
        [_] => anyhow::bail!("NS/POD@REVISION needs --manual-commit"),
        _ => anyhow::bail!("several pods are one transaction: add --manual-commit"),
    };
    let timeout_secs = match timeout {
        Some(t) => edgehub::upgrade::txn::parse_duration(t)
            .map_err(anyhow::Error::msg)?
            .as_secs(),
        None => 300,
    };
    let path = local::upgrade_path(pod, "upgrade").map_err(anyhow::Error::msg)?;
    let client = local_client(cli)?;
    let a = client.post(&path)?;
    if a.status != 200 {
        anyhow::bail!("{} {}", a.status, a.body.trim());
    }
    println!("{}", a.body.trim());
    if !wait {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_secs);
    let mut last = String::new();
    loop {
        let a = client.get(&path)?;
        if a.status != 200 {
            anyhow::bail!("{} {}", a.status, a.body.trim());
        }
        let v: serde_json::Value = serde_json::from_str(&a.body)?;
        let state = v["state"].as_str().unwrap_or("?").to_string();
        if state != last {
            println!("{pod}: {state}");
            last = state.clone();
        }
        match state.as_str() {
            "Done" => return Ok(()),
            "RolledBack" | "Failed" => anyhow::bail!(
                "upgrade of {pod} ended {state}: {}",
                v["error"].as_str().unwrap_or("no error recorded")
            ),
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("gave up after {timeout_secs}s; the upgrade of {pod} is still {state}");
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}
