//! The admin socket: a Unix socket (mode 0600) speaking one JSON request line and one
//! JSON reply line per connection. Only root (or the agent's user) can reach it, so it
//! needs no signatures; it is how `fort-agent status|trigger|gc|reload` talk to the daemon.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::app::App;
use crate::provider::Trigger;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase", deny_unknown_fields)]
pub enum AdminRequest {
    Status,
    Trigger {
        capability: String,
        #[serde(default)]
        force: bool,
        #[serde(default)]
        reason: Option<String>,
    },
    Gc {
        #[serde(default)]
        dry_run: bool,
    },
    Reload,
}

pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A stale socket from a killed agent would make bind fail.
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

pub async fn serve(app: Arc<App>, listener: UnixListener) {
    loop {
        let stream = tokio::select! {
            s = listener.accept() => match s {
                Ok((s, _)) => s,
                Err(_) => continue,
            },
            _ = app.shutdown.cancelled() => return,
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _ = handle(app, stream).await;
        });
    }
}

async fn handle(app: Arc<App>, stream: UnixStream) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    BufReader::new(tokio::io::AsyncReadExt::take(read, 64 * 1024))
        .read_line(&mut line)
        .await?;
    let reply = match serde_json::from_str::<AdminRequest>(&line) {
        Ok(req) => execute(&app, req).await,
        Err(e) => json!({"ok": false, "error": format!("bad admin request: {e}")}),
    };
    let mut out = serde_json::to_vec(&reply).expect("reply serialises");
    out.push(b'\n');
    write.write_all(&out).await
}

async fn execute(app: &Arc<App>, req: AdminRequest) -> Value {
    match req {
        AdminRequest::Status => json!({"ok": true, "status": crate::builtins::status(app, true)}),
        AdminRequest::Reload => match app.reload().await {
            Ok(()) => json!({"ok": true}),
            Err(e) => json!({"ok": false, "error": e}),
        },
        AdminRequest::Gc { dry_run } => {
            let report = crate::provider::gc::run_once(app, dry_run).await;
            json!({"ok": true, "report": report})
        }
        AdminRequest::Trigger {
            capability,
            force,
            reason,
        } => {
            let loaded = app.loaded.load_full();
            match loaded.capabilities.get(&capability) {
                Some(c) if c.mode == fort_core::schema::Mode::Async => {}
                Some(_) => {
                    return json!({"ok": false, "error": format!("{capability} is an rpc capability; nothing to trigger")})
                }
                None => return json!({"ok": false, "error": format!("no capability {capability}")}),
            }
            let trigger = match reason.as_deref() {
                Some("systemd") => Trigger::Systemd,
                None | Some("manual") => Trigger::Manual,
                Some(other) => {
                    return json!({"ok": false, "error": format!("unknown reason {other:?} (manual, systemd)")})
                }
            };
            let rx = app
                .provider
                .enqueue(app, &capability, trigger, false, force);
            match rx.await {
                Ok(record) => json!({"ok": record.ok, "run": record, "error": record.error}),
                Err(_) => json!({"ok": false, "error": "agent is shutting down"}),
            }
        }
    }
}

/// Client side: send one request, read one reply.
pub async fn call(path: &Path, req: &AdminRequest) -> Result<Value, String> {
    let stream = UnixStream::connect(path).await.map_err(|e| {
        format!(
            "cannot reach the agent at {}: {e} (is fort-agent running?)",
            path.display()
        )
    })?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_vec(req).expect("request serialises");
    line.push(b'\n');
    write.write_all(&line).await.map_err(|e| e.to_string())?;
    let mut reply = String::new();
    BufReader::new(read)
        .read_line(&mut reply)
        .await
        .map_err(|e| e.to_string())?;
    serde_json::from_str(&reply).map_err(|e| format!("bad reply from agent: {e}"))
}
