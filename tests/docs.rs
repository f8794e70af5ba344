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

#[test]
fn the_readme_test_command_is_what_ci_runs_and_it_lists_what_was_skipped() {
    let root = repo();
    let readme = read(&root.join("README.md"));
    let ci = read(&root.join(".ci/run"));
    assert!(
        readme.lines().any(|l| l.starts_with("scripts/test.sh ")),
        "README.md does not give scripts/test.sh as its test command"
    );
    assert!(
        ci.lines().any(|l| l.trim() == "scripts/test.sh"),
        ".ci/run does not run the README's test command"
    );
    // The script, with a stand-in cargo that runs one test which skips a part of itself.
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let cargo = bin.join("cargo");
    std::fs::write(
        &cargo,
        "#!/bin/sh\necho \"$*\" > \"$FORT_SKIPPED.args\"\necho 'some_test: nixpkgs lib not found; set NIXPKGS_LIB=/path' >> \"$FORT_SKIPPED\"\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let skipped = dir.path().join("skipped.txt");
    let run = |args: &[&str]| {
        std::process::Command::new(root.join("scripts/test.sh"))
            .args(args)
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .env("FORT_SKIPPED", &skipped)
            // Its own figures file: the script empties the one it is given, and the run
            // this test is part of has its lanes' figures in the real one.
            .env("FORT_FIGURES", dir.path().join("figures.txt"))
            .env_remove("NIXPKGS_LIB")
            .output()
            .unwrap()
    };
    let out = run(&["-E", "test(x)"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "the tests' status is the script's"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("skipped.txt.args")).unwrap(),
        "nextest run --workspace --locked -E test(x)\n"
    );
    assert!(
        stdout.contains("Skipped: 1 part(s) of tests did not run here")
            && stdout.contains("  SKIP some_test: nixpkgs lib not found; set NIXPKGS_LIB=/path")
            && stdout.contains("NIXPKGS_LIB is not set"),
        "{stdout}"
    );
    // Nothing skipped: it says so.
    std::fs::write(&cargo, "#!/bin/sh\nexit 0\n").unwrap();
    let out = run(&[]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("Skipped: none"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The lines of the first fenced block of `lang` after `heading` in `text`.
fn block_after(text: &str, heading: &str, lang: &str) -> String {
    let from = text
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    let rest = &text[from..];
    let open = format!("```{lang}\n");
    let start = rest.find(&open).expect("a fenced block") + open.len();
    let end = rest[start..].find("```").expect("the block's end") + start;
    rest[start..end].to_owned()
}

/// docs/protocol.md §12.4: the example trail verifies with fort's verifier and, through
/// scripts/audit-checkpoint.sh, with `ssh-keygen -Y verify` alone; with one record
/// changed, both refuse it, and fort names that record.
#[test]
fn the_audit_example_verifies_with_openssh_and_fort() {
    let root = repo();
    let doc = read(&root.join("docs/protocol.md"));
    let example = block_after(&doc, "### 12.4 Example", "jsonl");
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM";
    assert!(doc.contains(key), "the example's key is not forge's of §3");
    let keys = vec![fort_core::sign::parse_public_key(key).unwrap()];
    let ssh_keygen = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("ssh-keygen").is_file()));
    if !ssh_keygen {
        fort_tests::skip(
            "the_audit_example_verifies_with_openssh_and_fort",
            "ssh-keygen is not installed; fort's own verifier is checked only",
        );
    }
    let check = |text: &str| {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("0000000000000001.jsonl");
        std::fs::write(&file, text).unwrap();
        let fort = fort_core::audit::verify(dir.path(), "forge", &keys).unwrap();
        let openssh = ssh_keygen.then(|| {
            std::process::Command::new("sh")
                .arg(root.join("scripts/audit-checkpoint.sh"))
                .arg(&file)
                .arg("4")
                .arg("forge")
                .arg(key)
                .output()
                .unwrap()
                .status
                .success()
        });
        (fort, openssh)
    };
    let (fort, openssh) = check(&example);
    assert!(fort.problems.is_empty(), "{:?}", fort.problems);
    assert_eq!((fort.records, fort.checkpoints), (4, 1));
    assert_eq!(fort.signed_through, Some(3));
    assert_ne!(openssh, Some(false), "ssh-keygen refuses the example");

    // The checkpoint's witness (§12.3a) verifies alone, with fort and with ssh-keygen
    // over its line, and not for another count.
    let record: serde_json::Value = serde_json::from_str(example.lines().nth(3).unwrap()).unwrap();
    let witnessed = fort_core::audit::Witnessed {
        count: record["count"].as_u64().unwrap(),
        head: record["head"].as_str().unwrap().to_owned(),
        at: record["at"].as_u64().unwrap(),
        witness: record["witness"]
            .as_str()
            .expect("the example's witness")
            .to_owned(),
    };
    assert!(witnessed.verifies("forge", &keys));
    let moved = fort_core::audit::Witnessed {
        count: 2,
        ..witnessed.clone()
    };
    assert!(!moved.verifies("forge", &keys));
    if ssh_keygen {
        let dir = tempfile::tempdir().unwrap();
        let sig = dir.path().join("witness.sig");
        std::fs::write(
            &sig,
            format!(
                "-----BEGIN SSH SIGNATURE-----\n{}\n-----END SSH SIGNATURE-----\n",
                witnessed.witness
            ),
        )
        .unwrap();
        let allowed = dir.path().join("allowed");
        std::fs::write(&allowed, format!("forge namespaces=\"fort-audit\" {key}\n")).unwrap();
        let line =
            fort_core::audit::witness_line("forge", witnessed.count, &witnessed.head, witnessed.at);
        let mut child = std::process::Command::new("ssh-keygen")
            .args(["-Y", "verify", "-f"])
            .arg(&allowed)
            .args(["-I", "forge", "-n", "fort-audit", "-s"])
            .arg(&sig)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(line.as_bytes())
            .unwrap();
        assert!(
            child.wait().unwrap().success(),
            "ssh-keygen refuses the witness"
        );
    }

    let changed = example.replacen("\"expires_at\":1769817601", "\"expires_at\":1799817601", 1);
    assert_ne!(changed, example);
    let (fort, openssh) = check(&changed);
    assert_ne!(openssh, Some(true), "ssh-keygen accepts a changed record");
    let first = fort.problems.first().expect("a problem");
    assert_eq!((first.line, first.seq), (3, Some(3)), "{first}");
}

/// Every command line of the README's "Commands" block is one its program takes: each
/// subcommand exists, and each option it shows is among those the subcommand's help lists
/// (a README that shows `fort audit show --signer` while `show` refuses it is caught).
#[test]
fn the_readme_commands_are_what_the_programs_take() {
    let readme = read(&repo().join("README.md"));
    let block = readme
        .split("## Commands")
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .expect("a Commands block");
    let mut checked = 0;
    for line in block.lines() {
        let Some(program) = ["fort-agent ", "fort "]
            .into_iter()
            .find(|p| line.starts_with(p))
        else {
            continue;
        };
        // The command line proper, before the two or more spaces of its description.
        let command = line.split("   ").next().unwrap_or(line);
        let words: Vec<&str> = command.split_whitespace().collect();
        let subcommand: Vec<&str> = words[1..]
            .iter()
            .take_while(|w| {
                !w.starts_with('-') && w.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            })
            .copied()
            .collect();
        // `show|verify`-style alternatives are not one command: each is written out.
        assert!(
            !words.iter().any(|w| w.contains('|')
                && w.split('|')
                    .all(|part| !part.is_empty() && part.chars().all(|c| c.is_ascii_lowercase()))),
            "{line}"
        );
        let out = std::process::Command::new(fort_tests::bin(program.trim()))
            .args(&subcommand)
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{line}: {program}{} --help failed",
            subcommand.join(" ")
        );
        for flag in words
            .iter()
            .filter(|w| w.trim_start_matches('[').starts_with("--"))
        {
            let flag = flag
                .trim_start_matches('[')
                .trim_end_matches([']', '…'])
                .split(['=', ']'])
                .next()
                .unwrap_or_default();
            assert!(
                help.contains(flag),
                "README: `{command}`: {program}{} takes no {flag}:\n{help}",
                subcommand.join(" ")
            );
        }
        checked += 1;
    }
    assert!(checked >= 25, "{checked} command lines checked");
}
