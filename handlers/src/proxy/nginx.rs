//! What the handler does outside itself: the include directory's files it owns, and the
//! configured test and reload commands, run as argument vectors (never through a shell),
//! each with a timeout.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_core::process::{self, RunError, RunSpec};

/// How a command ended, when it ran to its end.
#[derive(Debug, PartialEq)]
pub enum Ran {
    Passed,
    /// Exit status other than 0: what it printed (stderr, then stdout), bounded.
    Failed(String),
}

/// Runs `argv` (fort's subprocess helper: no shell, a cleared environment but `PATH`, the
/// whole process tree killed at the timeout). An error means the command could not run
/// or did not end in time: nothing can be concluded about the config.
pub async fn run(argv: &[String], timeout: Duration) -> anyhow::Result<Ran> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("an empty command"))?;
    let spec = RunSpec::new(program, Vec::new(), timeout).args(args.iter().cloned());
    match process::run(&spec).await {
        Ok(_) => Ok(Ran::Passed),
        Err(RunError::Exit {
            code,
            stderr,
            stdout,
        }) => {
            let mut text = stderr;
            text.push_str(&stdout);
            if text.trim().is_empty() {
                text = format!("{program} exited with code {code}");
            }
            Ok(Ran::Failed(text))
        }
        Err(e) => Err(anyhow::anyhow!("{program}: {}", e.summary())),
    }
}

/// The line of a failed test that says why: nginx's first `[emerg]` (or error) line,
/// without the program prefix; else the first line.
pub fn reason(output: &str) -> String {
    let lines: Vec<&str> = output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let line = lines
        .iter()
        .find(|l| l.contains("[emerg]") || l.contains("[crit]") || l.contains("[alert]"))
        .or_else(|| lines.iter().find(|l| l.contains("[error]")))
        .or(lines.first())
        .copied()
        .unwrap_or("the test command failed");
    line.strip_prefix("nginx: ").unwrap_or(line).to_owned()
}

/// The handler's files in the include directory as it has left them: file name → its
/// content (`None`: no file). Writes only what differs, each file whole (a temporary
/// file renamed over it, named so that `*.conf` never matches it half-written).
pub struct Dir {
    path: PathBuf,
    files: BTreeMap<String, Option<String>>,
    /// Something was written or removed since the last `sync`.
    dirty: bool,
}

impl Dir {
    pub fn new(path: &Path) -> Dir {
        Dir {
            path: path.to_owned(),
            files: BTreeMap::new(),
            dirty: false,
        }
    }

    pub fn path_of(&self, file: &str) -> PathBuf {
        self.path.join(file)
    }

    /// The file's content now (`None`: none, or unreadable as text).
    pub fn read(&mut self, file: &str) -> anyhow::Result<Option<String>> {
        if let Some(known) = self.files.get(file) {
            return Ok(known.clone());
        }
        let text = match std::fs::read(self.path_of(file)) {
            Ok(bytes) => Some(String::from_utf8_lossy(&bytes).into_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => anyhow::bail!("cannot read {}: {e}", self.path_of(file).display()),
        };
        self.files.insert(file.to_owned(), text.clone());
        Ok(text)
    }

    /// Makes the file hold `content` (`None`: removes it).
    pub fn set(&mut self, file: &str, content: Option<&str>) -> anyhow::Result<()> {
        if self.read(file)?.as_deref() == content {
            return Ok(());
        }
        let path = self.path_of(file);
        match content {
            Some(text) => {
                let tmp = self.path.join(format!(".{file}.tmp"));
                let written = std::fs::File::create(&tmp)
                    .and_then(|mut f| f.write_all(text.as_bytes()))
                    .and_then(|()| std::fs::rename(&tmp, &path));
                if let Err(e) = written {
                    let _ = std::fs::remove_file(&tmp);
                    anyhow::bail!("cannot write {}: {e}", path.display());
                }
            }
            None => match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => anyhow::bail!("cannot remove {}: {e}", path.display()),
            },
        }
        self.files
            .insert(file.to_owned(), content.map(str::to_owned));
        self.dirty = true;
        Ok(())
    }

    /// Whether anything was written or removed since the last `sync`.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Makes the renames and removals durable (one fsync of the directory) before the
    /// state records them. The files' own data is not flushed one by one (thousands of
    /// fsyncs would eat a run's minute): after a power cut a vhost can at worst be
    /// empty, which nginx loads as nothing, and the next reconciling run (`initialize`
    /// at boot) finds it differs from the state and writes it again.
    pub fn sync(&mut self) -> anyhow::Result<()> {
        if self.dirty {
            std::fs::File::open(&self.path)
                .and_then(|d| d.sync_all())
                .map_err(|e| anyhow::anyhow!("cannot sync {}: {e}", self.path.display()))?;
        }
        self.dirty = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_come_from_the_emerg_line() {
        let out = "nginx: [warn] something\nnginx: [emerg] cannot load certificate \"/x\": BIO_new_file() failed\nnginx: configuration file /c test failed\n";
        assert_eq!(
            reason(out),
            "[emerg] cannot load certificate \"/x\": BIO_new_file() failed"
        );
        assert_eq!(reason(""), "the test command failed");
    }

    #[tokio::test]
    async fn commands_run_without_a_shell() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t = Duration::from_secs(5);
        assert_eq!(run(&argv(&["true"]), t).await.unwrap(), Ran::Passed);
        match run(&argv(&["sh", "-c", "echo no >&2; exit 3"]), t)
            .await
            .unwrap()
        {
            Ran::Failed(text) => assert_eq!(text.trim(), "no"),
            other => panic!("{other:?}"),
        }
        assert!(run(&argv(&["echo; true"]), t).await.is_err());
        assert!(run(&argv(&["sleep", "5"]), Duration::from_millis(100))
            .await
            .is_err());
    }

    #[test]
    fn writes_only_what_differs() {
        let d = tempfile::tempdir().unwrap();
        let mut dir = Dir::new(d.path());
        dir.set("fort.a.conf", Some("x")).unwrap();
        assert!(dir.is_dirty());
        dir.sync().unwrap();
        dir.set("fort.a.conf", Some("x")).unwrap();
        assert!(!dir.is_dirty());
        assert_eq!(
            std::fs::read_to_string(d.path().join("fort.a.conf")).unwrap(),
            "x"
        );
        dir.set("fort.a.conf", None).unwrap();
        assert!(!d.path().join("fort.a.conf").exists());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
