//! Every command's `--help`, as a newcomer reads it: each argument and option says what
//! it is, the defaults a user cannot guess are named, and the text speaks of what the
//! command does (no tracker references).

use std::process::Command;

fn help(bin: &str, args: &[&str]) -> String {
    let out = Command::new(fort_tests::bin(bin))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{bin} {args:?} --help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The subcommands a `--help` lists (but `help`).
fn subcommands(text: &str) -> Vec<String> {
    let Some(start) = text.find("\nCommands:\n") else {
        return Vec::new();
    };
    text[start + 11..]
        .lines()
        .take_while(|l| !l.is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// Arguments and options listed without a description: clap prints them as the
/// name alone, or followed straight by `[default: …]` or `[env: …]`. The description is
/// on the same line, or (long help) on the next, indented further.
fn undescribed(text: &str) -> Vec<String> {
    let is_description =
        |d: &str| !d.is_empty() && !d.starts_with("[default") && !d.starts_with("[env");
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut in_list = false;
    for (i, line) in lines.iter().enumerate() {
        if *line == "Arguments:" || *line == "Options:" {
            in_list = true;
            continue;
        }
        if !line.is_empty() && !line.starts_with(' ') {
            in_list = false;
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        // Argument lines start near the margin; descriptions continue further right.
        if !in_list || line.trim().is_empty() || indent > 6 {
            continue;
        }
        let trimmed = line.trim_start();
        let same_line = trimmed
            .split_once("  ")
            .is_some_and(|(_, rest)| is_description(rest.trim_start()));
        let next_line = lines.get(i + 1).is_some_and(|n| {
            let d = n.trim();
            n.len() - n.trim_start().len() > indent
                && is_description(d)
                && !d.starts_with('-')
                && !d.starts_with('<')
        });
        if !same_line && !next_line {
            out.push(trimmed.to_owned());
        }
    }
    out
}

#[test]
fn every_argument_and_option_has_help_and_no_text_cites_a_tracker() {
    for bin in ["fort", "fort-agent", "fort-bench"] {
        let top = help(bin, &[]);
        assert!(
            !subcommands(&top).is_empty(),
            "{bin}: no subcommands found in\n{top}"
        );
        // Every command, nested ones included (`fort-agent audit show`): clap checks a
        // subcommand's arguments only when it is reached, so each one's --help is asked.
        let mut todo = vec![(Vec::<String>::new(), top)];
        while let Some((args, text)) = todo.pop() {
            let missing = undescribed(&text);
            assert!(
                missing.is_empty(),
                "{bin} {args:?}: no help for {missing:?}\n{text}"
            );
            let lower = text.to_lowercase();
            assert!(
                !lower.contains("issue ") && !lower.contains("session"),
                "{bin} {args:?} speaks of the tracker:\n{text}"
            );
            for sub in subcommands(&text) {
                let mut deeper = args.clone();
                deeper.push(sub);
                let words: Vec<&str> = deeper.iter().map(String::as_str).collect();
                let text = help(bin, &words);
                todo.push((deeper, text));
            }
        }
    }
}

#[test]
fn fort_names_its_default_key_and_origin() {
    let text = help("fort", &[]);
    assert!(text.contains("~/.ssh/id_ed25519"), "{text}");
    assert!(text.contains("$USER"), "{text}");
    let journal = help("fort", &["journal"]);
    for what in ["<HOST>", "<UNIT>", "--lines", "--since", "--until"] {
        assert!(journal.contains(what), "{what}: {journal}");
    }
}

#[test]
fn the_help_reader_finds_what_is_missing() {
    let text = "Usage: x\n\nArguments:\n  <HOST>  A host\n  <UNIT>\n\nOptions:\n      --lines <LINES>  [default: 100]\n      --since <SINCE>\n  -h, --help       Print help\n";
    assert_eq!(
        undescribed(text),
        [
            "<UNIT>",
            "--lines <LINES>  [default: 100]",
            "--since <SINCE>"
        ]
    );
    let long = "Options:\n      --config <FILE>\n          The config\n\n          [default: x]\n\n      --new <FILE>\n\n";
    assert_eq!(undescribed(long), ["--new <FILE>"]);
}
