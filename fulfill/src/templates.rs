//! Files rendered from templates over several needs' payloads (docs/protocol.md §11.14):
//! a template is rendered once every need it reads is satisfied, and again whenever one
//! of their payloads changes; the file is written like a need's file (owner, mode, an
//! atomic swap, as a systemd encrypted credential when asked), and the units that use it
//! are restarted once per change. Rendering is Jinja's syntax through minijinja:
//! sandboxed (no code, no file, no include), a missing value is an error (nothing half
//! rendered is written), and its work is bounded by fuel, since the values it loops over
//! come from providers.
//!
//! What a template last rendered (the payloads' hashes, the file's hash, an encrypted
//! file's digest) is kept in `templates-state.json`: a restart renders nothing again and
//! restarts nothing unless an input changed or the file was lost.

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use fort_core::canonical::sha256_hex;
use fort_core::names::NeedKey;
use fort_core::schema::{TemplateSpec, Templates};
use fort_core::store::{PersistError, Store};
use fort_core::wire::unix_now;
use serde::{Deserialize, Serialize};

use crate::credentials::{CredentialRecord, Sealed, SealedFile};
use crate::Fulfiller;

/// The file, and the field of its snapshot that holds the templates' records.
pub const FILE: &str = "templates-state.json";
pub const FIELD: &str = "templates";

/// The most a rendering may be.
const MAX_RENDERED_BYTES: usize = 1024 * 1024;

/// The work one rendering may do (minijinja's fuel: about one unit per instruction):
/// plenty for any file a service reads, never a loop over a provider's values that runs
/// away.
const FUEL: u64 = 2_000_000;

/// What a template last rendered, and where it stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TemplateState {
    /// Per need read, the SHA-256 of the payload it was rendered from.
    #[serde(default)]
    pub inputs: BTreeMap<String, String>,
    /// SHA-256 of the rendering (never the rendering).
    #[serde(default)]
    pub rendered_sha256: Option<String>,
    /// The file written: path → SHA-256 of what was written.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// An encrypted file's digest and the SHA-256 of its ciphertext (§11.3).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub credentials: BTreeMap<String, CredentialRecord>,
    #[serde(default)]
    pub rendered_at: Option<u64>,
    /// Why it is not rendered now (waiting for a need, a rendering error), one line.
    #[serde(default)]
    pub reason: Option<String>,
    /// SHA-256 of the file's declaration (path, owner, mode, encryption) it was written
    /// with: a changed declaration is written again even when the rendering is the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declared_sha256: Option<String>,
}

/// The templates a host declares and their records.
#[derive(Default)]
pub(crate) struct TemplateRoom {
    pub specs: parking_lot::Mutex<Arc<Templates>>,
    pub store: std::sync::OnceLock<Store<TemplateState>>,
    /// One rendering or removal at a time: two must never write (or one write and one
    /// remove) one file. `specs` is read under it, so whoever holds it acts on the
    /// templates declared now, and on every record the one before it left.
    pub render: tokio::sync::Mutex<()>,
}

/// A template as minijinja runs it: no auto-escaping (these are config files, not HTML),
/// a missing value an error, the work bounded.
fn environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_fuel(Some(FUEL));
    // A config file ends as it is written.
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .keep_trailing_newline(true)
            .build()
            .expect("the default delimiters"),
    );
    env
}

/// Whether `text` is a template minijinja takes; the error, one line, when not.
pub fn compile(name: &str, text: &str) -> Result<(), String> {
    let env = environment();
    env.template_from_named_str(name, text)
        .map(|_| ())
        .map_err(|e| one_line(&e))
}

fn one_line(e: &minijinja::Error) -> String {
    fort_core::text::printable(&e.to_string().replace('\n', " "), 300)
}

/// `text` rendered over `needs` (each need's payload, as JSON when it is JSON).
fn render(
    name: &str,
    text: &str,
    needs: &BTreeMap<String, serde_json::Value>,
) -> Result<Vec<u8>, String> {
    let env = environment();
    let template = env
        .template_from_named_str(name, text)
        .map_err(|e| one_line(&e))?;
    // Fuel bounds the work, not the output: a loop over a long list printing a long
    // value stays within it. The writer stops the rendering at the bound instead.
    let mut out = Bounded(Vec::new());
    let result = template
        .render_captured_to(
            minijinja::context! { needs => minijinja::value::Serde(needs) },
            &mut out,
        )
        .map(drop);
    match result {
        Ok(()) => Ok(out.0),
        Err(_) if out.0.len() >= MAX_RENDERED_BYTES => Err(format!(
            "the rendering is over {MAX_RENDERED_BYTES} bytes, the most a template renders"
        )),
        Err(e) => Err(one_line(&e)),
    }
}

/// The rendering, refused past [`MAX_RENDERED_BYTES`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED_BYTES {
            self.0.resize(MAX_RENDERED_BYTES, 0);
            return Err(std::io::Error::other("rendering too large"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The paths the declared templates write.
fn declared_paths(specs: &Templates) -> std::collections::HashSet<String> {
    specs
        .values()
        .map(|spec| spec.path.to_string_lossy().into_owned())
        .collect()
}

impl Fulfiller {
    /// Whether `key` is satisfied by the payload `OK` alone (§7): no handler, no files, no
    /// keys, and no template reads it (a template's input is a payload like any other).
    pub(crate) fn side_effect_only(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
    ) -> bool {
        spec.side_effect_only() && !self.inner.view.lock().template_inputs.contains(key)
    }

    /// Where the templates' records are kept; set once, before the first reload.
    pub fn set_template_store(&self, store: Store<TemplateState>) {
        let _ = self.inner.templates.store.set(store);
    }

    /// The templates declared now (a reload replaces them), and the needs they read.
    pub fn set_templates(&self, templates: Templates) {
        let inputs: std::collections::HashSet<NeedKey> =
            templates.values().flat_map(TemplateSpec::inputs).collect();
        self.inner.view.lock().template_inputs = inputs;
        *self.inner.templates.specs.lock() = Arc::new(templates);
        let me = self.clone();
        self.inner.tasks.spawn(async move {
            me.remove_undeclared_templates().await;
            me.render_templates(None).await;
        });
    }

    /// The records of the templates, by name (for status).
    pub fn template_states(&self) -> BTreeMap<String, TemplateState> {
        let names: Vec<String> = self.inner.templates.specs.lock().keys().cloned().collect();
        let Some(store) = self.inner.templates.store.get() else {
            return BTreeMap::new();
        };
        store.read(|m| {
            names
                .into_iter()
                .map(|n| {
                    let st = m.get(&n).cloned().unwrap_or_else(|| TemplateState {
                        reason: Some("not rendered yet".into()),
                        ..TemplateState::default()
                    });
                    (n, st)
                })
                .collect()
        })
    }

    /// Renders every template that reads `changed` (all, with `None`), each one whose
    /// inputs or file changed since it was last written.
    pub(crate) async fn render_templates(&self, changed: Option<&NeedKey>) {
        let _one = self.inner.templates.render.lock().await;
        // Read once the turn is ours: a rendering that waited behind a reload renders
        // what is declared now, never a template the reload took away.
        let specs = self.inner.templates.specs.lock().clone();
        let declared = declared_paths(&specs);
        for (name, spec) in specs.iter() {
            if changed.is_some_and(|k| !spec.inputs().contains(k)) {
                continue;
            }
            if let Err(e) = self.render_one(name, spec, &declared).await {
                tracing::warn!(template = %name, error = %e, "template not recorded");
            }
        }
    }

    async fn render_one(
        &self,
        name: &str,
        spec: &TemplateSpec,
        declared_paths: &std::collections::HashSet<String>,
    ) -> Result<(), PersistError> {
        let Some(store) = self.inner.templates.store.get() else {
            return Ok(());
        };
        let before = store.read(|m| m.get(name).cloned()).unwrap_or_default();
        let mut inputs = BTreeMap::new();
        let mut values = BTreeMap::new();
        for key in spec.inputs() {
            let st = self.state(&key);
            if !st.satisfied {
                return self
                    .template_waits(store, name, &before, format!("waiting for {key}"))
                    .await;
            }
            let Some(payload) = st
                .payload
                .as_deref()
                .and_then(|p| base64::engine::general_purpose::STANDARD.decode(p).ok())
            else {
                // Satisfied before a template read it: its payload was not kept. Asked
                // for again, its provider sends it once more.
                self.ask_now(&key);
                return self
                    .template_waits(
                        store,
                        name,
                        &before,
                        format!("asking {key} for its payload again"),
                    )
                    .await;
            };
            inputs.insert(key.to_string(), sha256_hex(&payload));
            let value = serde_json::from_slice(&payload).unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&payload).into_owned())
            });
            values.insert(key.to_string(), value);
        }
        let (n, text) = (name.to_owned(), spec.template.clone());
        let rendered = tokio::task::spawn_blocking(move || render(&n, &text, &values))
            .await
            .unwrap_or_else(|e| Err(format!("rendering failed: {e}")));
        let rendered = match rendered {
            Ok(r) => r,
            Err(why) => {
                tracing::warn!(template = %name, error = %why, "template not rendered");
                return self
                    .template_waits(store, name, &before, format!("not rendered: {why}"))
                    .await;
            }
        };
        let digest = sha256_hex(&rendered);
        let file = spec.file(name);
        let declared = sha256_hex(&serde_json::to_vec(&file).unwrap_or_default());
        let path = file.path.to_string_lossy().into_owned();
        let on_disk = {
            let files = before.files.clone();
            tokio::task::spawn_blocking(move || crate::files::missing(&files).is_none())
                .await
                .unwrap_or(false)
        };
        if before.rendered_sha256.as_deref() == Some(digest.as_str())
            && before.declared_sha256.as_deref() == Some(declared.as_str())
            && on_disk
            && before.files.contains_key(&path)
        {
            if before.inputs != inputs || before.reason.is_some() {
                let st = TemplateState {
                    inputs,
                    reason: None,
                    ..before
                };
                store.change_durable(|c| c.put(name, st)).await?;
            }
            return Ok(());
        }
        // Encrypted first: should systemd-creds fail, nothing is written in plaintext.
        let mut sealed = Sealed::new();
        if let Some(with) = file.encrypt {
            let d = crate::credentials::digest(&file, with, &rendered);
            match self.creds().encrypt(name, with, &rendered).await {
                Ok(ciphertext) => {
                    sealed.insert(
                        file.path.clone(),
                        SealedFile {
                            ciphertext,
                            digest: d,
                        },
                    );
                }
                Err(e) => {
                    return self
                        .template_waits(store, name, &before, format!("file {path}: {e}"))
                        .await
                }
            }
        }
        let (f, data) = (file.clone(), rendered);
        let written = tokio::task::spawn_blocking(move || {
            crate::files::write_all(std::slice::from_ref(&f), &data, Vec::new(), None, &sealed)
        })
        .await
        .unwrap_or_else(|e| Err(format!("writing failed: {e}")));
        let written = match written {
            Ok(w) => w,
            Err(why) => return self.template_waits(store, name, &before, why).await,
        };
        let st = TemplateState {
            inputs,
            rendered_sha256: Some(digest),
            files: written.files.clone(),
            credentials: written.credentials.clone(),
            rendered_at: Some(unix_now()),
            reason: None,
            declared_sha256: Some(declared),
        };
        store.change_durable(|c| c.put(name, st)).await?;
        // A file the template wrote before under another path is the old declaration's:
        // it goes, so no copy of the rendering stays where nothing declares it (a path
        // another template declares now is that one's file).
        let stale: Vec<String> = before
            .files
            .keys()
            .filter(|p| **p != path && !declared_paths.contains(*p))
            .cloned()
            .collect();
        if !stale.is_empty() {
            let _ = tokio::task::spawn_blocking(move || crate::files::remove_all(&stale)).await;
        }
        if written.changed {
            tracing::info!(template = %name, path = %path, "template rendered");
            self.inner
                .units
                .request(&written.restarts(&spec.restart_units), &spec.reload_units);
        }
        Ok(())
    }

    /// Records why `name` is not rendered now; its file, if any, stays as it was.
    async fn template_waits(
        &self,
        store: &Store<TemplateState>,
        name: &str,
        before: &TemplateState,
        reason: String,
    ) -> Result<(), PersistError> {
        if before.reason.as_deref() == Some(reason.as_str()) {
            return Ok(());
        }
        let st = TemplateState {
            reason: Some(reason),
            ..before.clone()
        };
        store.change_durable(|c| c.put(name, st)).await
    }

    /// The files of templates no longer declared go, with their records. Under the
    /// rendering's lock: a rendering never writes a file while it is being removed, nor
    /// records one after its removal was decided.
    async fn remove_undeclared_templates(&self) {
        let Some(store) = self.inner.templates.store.get() else {
            return;
        };
        let _one = self.inner.templates.render.lock().await;
        let specs = self.inner.templates.specs.lock().clone();
        // A path a declared template names is that template's file now (one renamed,
        // or its path given to another): its record goes, the file stays.
        let declared = declared_paths(&specs);
        let gone: Vec<(String, Vec<String>)> = store.read(|m| {
            m.iter()
                .filter(|(n, _)| !specs.contains_key(*n))
                .map(|(n, st)| {
                    let files = st.files.keys().filter(|p| !declared.contains(*p));
                    (n.clone(), files.cloned().collect())
                })
                .collect()
        });
        for (name, files) in gone {
            let paths = files.clone();
            let _ = tokio::task::spawn_blocking(move || crate::files::remove_all(&paths)).await;
            if let Err(e) = store.change_durable(|c| c.remove(&name)).await {
                tracing::warn!(template = %name, error = %e, "record of a removed template kept");
            } else {
                tracing::info!(template = %name, "template no longer declared: its file is removed");
            }
        }
    }
}

#[cfg(test)]
#[path = "templates_lock_tests.rs"]
mod lock_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn needs(v: serde_json::Value) -> BTreeMap<String, serde_json::Value> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn renders_values_of_several_needs_and_refuses_what_is_missing() {
        let text = "DATABASE_URL={{ needs[\"postgres/wiki\"].uri }}\nSECRET={{ needs[\"oidc/wiki\"].client_secret }}\n";
        let out = render(
            "env",
            text,
            &needs(serde_json::json!({
                "postgres/wiki": {"uri": "postgresql://wiki@db/wiki"},
                "oidc/wiki": {"client_secret": "s3cr3t"}
            })),
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "DATABASE_URL=postgresql://wiki@db/wiki\nSECRET=s3cr3t\n"
        );
        // A value the payload does not have: an error, nothing half rendered.
        let e = render(
            "env",
            text,
            &needs(serde_json::json!({"postgres/wiki": {"uri": "x"}, "oidc/wiki": {}})),
        )
        .unwrap_err();
        assert!(e.contains("undefined"), "{e}");
        // No markup is escaped: these are config files.
        let out = render(
            "x",
            "{{ needs.a.v }}",
            &needs(serde_json::json!({"a": {"v": "<&>\""}})),
        )
        .unwrap();
        assert_eq!(out, b"<&>\"");
    }

    #[test]
    fn a_provider_cannot_make_a_rendering_run_away() {
        // A template looping over a provider's array inside a loop over it: bounded.
        let big: Vec<u32> = (0..5000).collect();
        let e = render(
            "x",
            "{% for a in needs.n.v %}{% for b in needs.n.v %}.{% endfor %}{% endfor %}",
            &needs(serde_json::json!({"n": {"v": big}})),
        )
        .unwrap_err();
        assert!(e.contains("fuel") || e.contains("out of"), "{e}");
        // And no template can read a file or include another.
        assert!(render("x", "{% include 'etc/passwd' %}", &BTreeMap::new()).is_err());
        assert!(compile("x", "{{ unclosed").is_err());
    }
}

#[cfg(test)]
mod bounds {
    use super::*;

    /// The output is bounded while it is made, not after: a loop printing a long value
    /// within the fuel is stopped at the bound, with a message saying so.
    #[test]
    fn a_rendering_past_its_bound_is_refused() {
        let needs = BTreeMap::from([("x/y".to_owned(), serde_json::json!("a".repeat(1000)))]);
        let loop_over = "{% for i in range(2000) %}{{ needs[\"x/y\"] }}{% endfor %}";
        let err = render("t", loop_over, &needs).unwrap_err();
        assert!(err.contains("over"), "{err}");
        let small = render("t", "{{ needs[\"x/y\"] | length }}", &needs).unwrap();
        assert_eq!(small, b"1000");
    }
}
