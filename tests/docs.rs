//! The repository's documents hold together: the README's hand-signing script is the one
//! the test suite runs, and every relative link in the Markdown documents names a file
//! that exists.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_readme_shows_the_hand_signing_script_the_tests_run() {
    let root = repo();
    let script = read(&root.join("scripts/fort-curl.sh"));
    let body: Vec<&str> = script
        .lines()
        .skip_while(|l| !l.starts_with("KEY="))
        .collect();
    assert!(body.len() > 5, "scripts/fort-curl.sh has no KEY= line");
    let readme = read(&root.join("README.md"));
    let block = body.join("\n");
    assert!(
        readme.contains(&block),
        "README.md does not show scripts/fort-curl.sh as it is:\n{block}"
    );
}

/// `](target)` links that are neither URLs nor anchors.
fn relative_links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            out.push(target.to_owned());
        }
        rest = &rest[end..];
    }
    out
}

#[test]
fn every_relative_link_in_the_documents_exists() {
    let root = repo();
    let mut docs = vec![root.join("README.md"), root.join("nixos-module/README.md")];
    for e in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            docs.push(p);
        }
    }
    let mut broken = Vec::new();
    for doc in &docs {
        let dir = doc.parent().expect("parent");
        for link in relative_links(&read(doc)) {
            if !dir.join(&link).exists() {
                broken.push(format!("{}: {link}", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
