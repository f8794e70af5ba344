//! Renderings and the removal of templates no longer declared take turns on one lock and
//! read the declared templates once it is theirs: a removal never runs beside a
//! rendering, a rendering that waited behind a reload never brings back a template the
//! reload took away, and a path another template declares is never removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fort_core::client::{ClientOptions, SignedClient};
use fort_core::schema::{TemplateSpec, Templates};
use fort_core::sign::Signer;
use fort_core::store::Store;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{TemplateState, FIELD, FILE};
use crate::{FulfillOptions, Fulfiller};

struct Host {
    dir: tempfile::TempDir,
    fulfiller: Fulfiller,
    store: Store<TemplateState>,
    stop: CancellationToken,
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        let stop = CancellationToken::new();
        let needs = Store::open(&dir.path().join(crate::state::FILE), crate::state::FIELD).unwrap();
        tokio::spawn(needs.clone().run_flusher(stop.clone()));
        let store: Store<TemplateState> = Store::open(&dir.path().join(FILE), FIELD).unwrap();
        tokio::spawn(store.clone().run_flusher(stop.clone()));
        let fulfiller = Fulfiller::new(
            FulfillOptions {
                host: "c".into(),
                handler_timeout: Duration::from_secs(10),
                per_provider_concurrency: 1,
                backoff: Duration::from_secs(1),
                request_timeout: Duration::from_secs(10),
                handler_environment: Vec::new(),
                systemctl: "/bin/true".into(),
                systemd_creds: "/nonexistent/systemd-creds".into(),
                batches: false,
                key_dir: dir.path().join("keys"),
                audit: fort_core::audit::Audit::disabled(),
            },
            needs,
            SignedClient::new("c", Signer::generate(), &ClientOptions::default()),
            TaskTracker::new(),
            stop.clone(),
        );
        fulfiller.set_template_store(store.clone());
        Host {
            dir,
            fulfiller,
            store,
            stop,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join("out").join(name)
    }

    /// `name` as an earlier run left it: its file written and recorded.
    async fn rendered_before(&self, name: &str, path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"rendered\n").unwrap();
        let st = TemplateState {
            files: [(path.to_string_lossy().into_owned(), "0".repeat(64))].into(),
            ..TemplateState::default()
        };
        self.store
            .change_durable(|c| c.put(name, st))
            .await
            .unwrap();
    }

    fn recorded(&self, name: &str) -> bool {
        self.store.read(|m| m.contains_key(name))
    }

    fn declare(&self, templates: &[(&str, &Path)]) {
        let specs: Templates = templates
            .iter()
            .map(|(name, path)| ((*name).to_owned(), spec(path)))
            .collect();
        *self.fulfiller.inner.templates.specs.lock() = Arc::new(specs);
    }
}

/// A template over no need: rendered as soon as it is its turn.
fn spec(path: &Path) -> TemplateSpec {
    serde_json::from_value(serde_json::json!({"template": "rendered\n", "needs": [], "path": path}))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_waits_for_the_rendering_in_progress() {
    let h = Host::new();
    let old = h.path("old.conf");
    h.rendered_before("old", &old).await;
    // A rendering holds the turn: the reload's removal waits for it.
    let turn = h.fulfiller.inner.templates.render.lock().await;
    h.fulfiller.set_templates(Templates::new());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(old.exists() && h.recorded("old"));
    drop(turn);
    for _ in 0..200 {
        if !old.exists() && !h.recorded("old") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the template no longer declared was not removed once the rendering was done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rendering_that_waited_renders_what_is_declared_now() {
    let h = Host::new();
    let old = h.path("old.conf");
    h.declare(&[("old", &old)]);
    let turn = h.fulfiller.inner.templates.render.lock().await;
    // A rendering asked for while `old` was declared waits for its turn …
    let waiting = {
        let f = h.fulfiller.clone();
        tokio::spawn(async move { f.render_templates(None).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // … while a reload takes `old` away.
    h.declare(&[]);
    drop(turn);
    waiting.await.unwrap();
    assert!(!old.exists() && !h.recorded("old"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_another_template_declares_is_not_removed() {
    let h = Host::new();
    let shared = h.path("app.conf");
    h.rendered_before("old", &shared).await;
    // Renamed: the new name writes the same path.
    h.declare(&[("new", &shared)]);
    h.fulfiller.remove_undeclared_templates().await;
    assert!(shared.exists() && !h.recorded("old"));
}
