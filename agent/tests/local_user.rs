//! What a local user can do to the files fort delivers, with real agents: swap a parent
//! directory for a symbolic link (root must not write, or delete, through it), put a FIFO,
//! a huge sparse file or a link to /dev/zero where a delivered file was (the agent must
//! start and answer), and name an owner that chown reads as "leave unchanged".

use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

fn provider(f: &mut Fleet, cap: &str) {
    let h = f.script(
        &format!("provide-{cap}"),
        r#"jq -c 'with_entries(.value = {"secret": ("s3cret-" + .key)})'"#,
    );
    f.capability("p", cap, json!({"handler": h, "mode": "async"}));
}

fn status_of(f: &Fleet, need: &str) -> Value {
    f.need_status("c", need)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_swapped_for_a_symlink_redirects_neither_writes_nor_removals() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let base = f.dir.path().join("shared");
    let victim = f.dir.path().join("victim");
    std::fs::create_dir_all(base.join("sub")).unwrap();
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("secret"), "root's own file").unwrap();
    let target = base.join("sub/secret");
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"nag_seconds": 60, "files": [{"path": target, "pointer": "/secret"}]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    assert!(std::fs::read_to_string(&target)
        .unwrap()
        .starts_with("s3cret-"));

    // The user swaps the directory for a link to a directory of its choice, and the
    // payload changes (a rotation): root must not write there.
    std::fs::remove_file(&target).unwrap();
    std::fs::remove_dir(base.join("sub")).unwrap();
    symlink(&victim, base.join("sub")).unwrap();
    f.host("c").needs.get_mut("cred/a").unwrap()["request"] = json!({"v": 2});
    f.write_files();
    f.agents["c"].hup();
    assert!(
        eventually(Duration::from_secs(10), || {
            status_of(&f, "cred/a")["reason"]
                .as_str()
                .is_some_and(|r| r.contains("symbolic link"))
        })
        .await,
        "{}",
        status_of(&f, "cred/a")
    );
    assert_eq!(
        std::fs::read_to_string(victim.join("secret")).unwrap(),
        "root's own file",
        "written through the link"
    );

    // Nor does removing the need delete through it.
    f.host("c").needs.clear();
    f.write_files();
    f.agents["c"].hup();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        std::fs::read_to_string(victim.join("secret")).unwrap(),
        "root's own file",
        "deleted through the link"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_user_puts_in_place_of_a_delivered_file_cannot_wedge_the_agent_at_start() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let file = f.dir.path().join("out/secret");
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"nag_seconds": 60, "files": [{"path": file, "pointer": "/secret"}]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    type Plant = fn(&Path);
    let plants: [(&str, Plant); 3] = [
        ("a FIFO", |p| {
            let status = std::process::Command::new("mkfifo")
                .arg(p)
                .status()
                .unwrap();
            assert!(status.success());
        }),
        ("a 2 GiB sparse file", |p| {
            let file = std::fs::File::create(p).unwrap();
            file.set_len(2 << 30).unwrap();
        }),
        ("a link to /dev/zero", |p| symlink("/dev/zero", p).unwrap()),
    ];
    for (what, plant) in plants {
        f.kill("c");
        std::fs::remove_file(&file).unwrap();
        plant(&file);
        let started = std::time::Instant::now();
        f.try_start_host("c")
            .unwrap_or_else(|e| panic!("with {what} in place: {e}"));
        // It answers, sees that the file is not what it wrote, and asks again.
        assert!(
            eventually(Duration::from_secs(15), || {
                f.all_satisfied("c")
                    && std::fs::read_to_string(&file).is_ok_and(|s| s.starts_with("s3cret-"))
            })
            .await,
            "with {what}: {}",
            status_of(&f, "cred/a")
        );
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "with {what}: {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_chown_reads_as_leave_unchanged_is_refused() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"nag_seconds": 60,
               "files": [{"path": f.dir.path().join("out/x"), "owner": "4294967295"}]}),
    );
    f.write_files();
    let err = f.try_start_host("c").expect_err("started with owner -1");
    assert!(err.contains("4294967295"), "{err}");
}
