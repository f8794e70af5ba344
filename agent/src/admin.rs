//! The admin socket: a Unix socket (mode 0600) speaking one JSON request line and one
//! JSON reply line per connection. Only root (or the agent's user) can reach it, so it
//! needs no signatures; it is how `fort-agent status|trigger|gc|reload|plan` talk to the
//! daemon.

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
    /// The status document; with `entries`, every provider entry too (hashes only).
    Status {
        #[serde(default)]
        entries: bool,
    },
    /// Needs per state and entries per capability, without the rows: cheap enough to
    /// poll often, however many needs and entries there are.
    Counts,
    Trigger {
        capability: String,
        /// One entry key: it is called back after the run, and `force` hides only its
        /// cached response.
        #[serde(default)]
        entry: Option<String>,
        #[serde(default)]
        force: bool,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Send the need's request to its provider again now.
    Resend {
        need: String,
    },
    Gc {
        #[serde(default)]
        dry_run: bool,
    },
    Reload,
    /// What loading these files would change; changes nothing. The files travel as
    /// text, so the agent needs no access to where they are.
    Plan {
        hosts: crate::plan::PlanFile,
        #[serde(default)]
        needs: Option<crate::plan::PlanFile>,
        #[serde(default)]
        capabilities: Option<crate::plan::PlanFile>,
        #[serde(default)]
        config: Option<crate::plan::PlanFile>,
    },
}

/// Binds the socket so that no one else can ever connect to it, not even for a moment:
/// it is created inside a fresh directory only this process may enter, given mode 0600
/// there, and only then renamed into place.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    let private = dir.join(format!(".fort-admin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("sock");
    let bound = (|| {
        let listener = UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        // A stale socket from a killed agent is replaced atomically.
        std::fs::rename(&staged, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    bound
}

/// Admin connections served at once; more wait for the kernel's backlog.
const ADMIN_CONNECTIONS: usize = 16;

/// The longest request line. A plan carries a fleet's hosts.json and a host's needs and
/// capabilities; only root (or the agent's user) can connect, so this only bounds
/// mistakes.
const REQUEST_LIMIT: u64 = 64 * 1024 * 1024;

pub async fn serve(app: Arc<App>, listener: UnixListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(ADMIN_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("semaphore open"),
            _ = app.shutdown.cancelled() => return,
        };
        let stream = tokio::select! {
            s = listener.accept() => match s {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = app.shutdown.cancelled() => return,
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = handle(app, stream).await;
        });
    }
}

async fn handle(app: Arc<App>, stream: UnixStream) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    // A client that connects and says nothing is dropped, as on the network listeners.
    let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(read, REQUEST_LIMIT));
    let reading = reader.read_line(&mut line);
    match tokio::time::timeout(app.config.header_read_timeout, reading).await {
        Ok(read) => {
            read?;
        }
        Err(_) => return Ok(()),
    }
    let reply = match serde_json::from_str::<AdminRequest>(&line) {
        Ok(req) => {
            let audited = audited_call(&req);
            let reply = execute(&app, req).await;
            if let Some(call) = audited {
                let ok = reply["ok"].as_bool().unwrap_or(false);
                // The admin socket is root's (or the agent user's), and still budgeted
                // like every caller: a runaway script must not rewrite the trail.
                app.audit.record_caused_by(
                    "local",
                    fort_core::audit::Event::caused(fort_core::audit::CausedKind::Operator)
                        .caller("local")
                        .status(if ok { 200 } else { 400 })
                        .detail(json!({"call": call, "params": params_of(&line)})),
                );
            }
            reply
        }
        Err(e) => json!({"ok": false, "error": format!("bad admin request: {e}")}),
    };
    let mut out = serde_json::to_vec(&reply).expect("reply serialises");
    out.push(b'\n');
    let _ = tokio::time::timeout(app.config.header_read_timeout, write.write_all(&out)).await;
    Ok(())
}

/// Calls on the admin socket that change something: the audit trail keeps them, with the
/// caller `local` (the socket is the agent's user's alone; `status` there is how the
/// host's own monitoring looks, and is not kept).
fn audited_call(req: &AdminRequest) -> Option<&'static str> {
    Some(match req {
        AdminRequest::Trigger { .. } => "trigger",
        AdminRequest::Resend { .. } => "resend",
        AdminRequest::Gc { dry_run: false } => "gc",
        _ => return None,
    })
}

/// The request line's parameters, bounded, for the trail.
fn params_of(line: &str) -> Value {
    serde_json::from_str::<Value>(line)
        .ok()
        .filter(|_| line.len() <= 1024)
        .unwrap_or_else(|| json!(format!("{} bytes", line.len())))
}

async fn execute(app: &Arc<App>, req: AdminRequest) -> Value {
    match req {
        AdminRequest::Status { entries } => {
            let entries = if entries {
                crate::builtins::Entries::Shown
            } else {
                crate::builtins::Entries::NotAsked
            };
            json!({"ok": true, "status": crate::builtins::status(app, entries)})
        }
        AdminRequest::Resend { need } => {
            let Some(key) = fort_core::names::NeedKey::parse(&need) else {
                return json!({"ok": false, "error": format!("{need:?} is not a need key <type>/<id>")});
            };
            match app.fulfiller.ask_now(&key) {
                Some(row) => json!({"ok": true, "resend": crate::rotate::resend_reply(&row)}),
                None => {
                    json!({"ok": false, "error": format!("{} declares no need {key}", app.config.host)})
                }
            }
        }
        AdminRequest::Counts => {
            let needs: serde_json::Map<String, Value> = app
                .fulfiller
                .counts()
                .iter()
                .map(|(phase, n)| (phase.as_str().to_owned(), json!(n)))
                .collect();
            let entries = app.provider.entry_counts();
            json!({"ok": true, "needs": needs, "entries": entries})
        }
        AdminRequest::Reload => match app.reload().await {
            Ok(()) => json!({"ok": true}),
            Err(e) => json!({"ok": false, "error": e}),
        },
        AdminRequest::Plan {
            hosts,
            needs,
            capabilities,
            config,
        } => {
            let req = crate::plan::PlanRequest {
                hosts,
                needs,
                capabilities,
                config,
            };
            // Parsing and comparing a large fleet's files takes a while: off the
            // runtime's threads.
            let app = app.clone();
            // A plan holds the files it was given, parsed, several times over; the heap
            // they took is handed back once it is answered, not kept by the allocator.
            let planned = tokio::task::spawn_blocking(move || {
                let plan = crate::plan::plan(&app, &req);
                drop(req);
                plan
            })
            .await;
            crate::app::trim_heap();
            match planned {
                Ok(Ok(plan)) => json!({"ok": true, "plan": plan}),
                Ok(Err(e)) => json!({"ok": false, "error": e}),
                Err(e) => json!({"ok": false, "error": format!("plan failed: {e}")}),
            }
        }
        AdminRequest::Gc { dry_run } => {
            let report = crate::provider::gc::run_once(app, dry_run).await;
            json!({"ok": true, "report": report})
        }
        AdminRequest::Trigger {
            capability,
            entry,
            force,
            reason,
        } => {
            let trigger = match reason.as_deref() {
                Some("systemd") => Trigger::Systemd,
                None | Some("manual") => Trigger::Manual,
                Some(other) => {
                    return json!({"ok": false, "error": format!("unknown reason {other:?} (manual, systemd)")})
                }
            };
            let ask = crate::provider::trigger::TriggerAsk {
                capability,
                entry,
                force,
                trigger,
            };
            match app.provider.trigger(app, ask).await {
                Ok(outcome) => json!({
                    "ok": outcome.run.ok,
                    "run": outcome.run,
                    "error": outcome.run.error,
                    "trigger": outcome,
                }),
                Err(e) => json!({"ok": false, "error": e.to_string()}),
            }
        }
    }
}

/// Why the admin socket at `path` could not be reached, and what to do about it.
fn unreachable(path: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::MetadataExt;
    let shown = path.display();
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => {
            // The socket (or, when it cannot be looked at, its directory) says whose it is.
            let owner = std::fs::metadata(path)
                .or_else(|_| std::fs::metadata(path.parent().unwrap_or(Path::new("/"))))
                .map(|m| m.uid())
                .ok();
            let who = match owner {
                Some(0) | None => "root".to_owned(),
                Some(uid) => format!("the user with uid {uid} (the agent's user)"),
            };
            let me = real_uid();
            format!(
                "permission denied on the admin socket {shown}: only {who} may use it (mode 0600; you are uid {me}). Run this command as {who} (e.g. with sudo); from elsewhere, `fort status HOST` asks the agent over the network as a principal"
            )
        }
        std::io::ErrorKind::NotFound => format!(
            "no admin socket at {shown}: fort-agent is not running (systemctl status fort-agent), or its agent.toml names another admin_socket (pass that file with --config)"
        ),
        std::io::ErrorKind::ConnectionRefused => format!(
            "nothing answers on the admin socket {shown}: fort-agent is not running (the socket is left from an earlier run; systemctl status fort-agent)"
        ),
        _ => format!("cannot reach the agent at {shown}: {e}"),
    }
}

/// This process's real user id (from /proc, to need no unsafe call).
fn real_uid() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next().map(str::to_owned))
        })
        .unwrap_or_else(|| "?".to_owned())
}

/// Client side: send one request, read one reply.
pub async fn call(path: &Path, req: &AdminRequest) -> Result<Value, String> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| unreachable(path, &e))?;
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
