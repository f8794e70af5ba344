//! One entry's vhost file: its name in the include directory (from the entry key, whose
//! parts are fort names), the marker line that says the handler wrote it and for which
//! entry, and the nginx config it holds. Only checked values go in (request.rs,
//! config.rs), so nothing here quotes or escapes.

use fort_core::names::{is_capability_name, is_host_name, is_principal_name};
use sha2::{Digest, Sha256};

use super::config::Config;
use super::request::Vhost;
use crate::common::Entry;

/// The first line of every file the handler writes, followed by the entry key.
pub const MARKER: &str = "# fort-handler proxy: ";

/// `fort.<origin>.<type>.<id>.conf`: the parts are fort names (no dots, no slashes), so
/// two entries never share a file and no name leaves the directory. `None` for a key
/// whose origin is no fort name.
pub fn file_name(entry: &Entry) -> Option<String> {
    let origin_ok = is_host_name(&entry.origin) || is_principal_name(&entry.origin);
    let (kind, id) = (entry.need.kind(), entry.need.id());
    (origin_ok && is_capability_name(kind) && is_capability_name(id))
        .then(|| format!("fort.{}.{kind}.{id}.conf", entry.origin))
}

/// Whether `name` is a file name this handler could have written (`fort.*.conf`).
pub fn is_ours_by_name(name: &str) -> bool {
    name.starts_with("fort.") && name.ends_with(".conf")
}

/// The marker line for `key`.
pub fn marker(key: &str) -> String {
    format!("{MARKER}{key}; written by fort, replaced and removed by it")
}

/// Whether `text` starts with the marker of `key` (of any entry when `key` is `None`).
pub fn has_marker(text: &str, key: Option<&str>) -> bool {
    let first = text.lines().next().unwrap_or("");
    match key {
        Some(k) => first == marker(k),
        None => first.starts_with(MARKER),
    }
}

/// The file's content.
pub fn render(config: &Config, key: &str, vhost: &Vhost) -> String {
    let names = vhost.server_names.join(" ");
    let mut out = marker(key);
    out.push('\n');
    let proxy = |target: &str| {
        format!(
            "        proxy_pass {target};\n        proxy_http_version 1.1;\n        \
             proxy_set_header Host $host;\n        proxy_set_header X-Real-IP $remote_addr;\n        \
             proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n        \
             proxy_set_header X-Forwarded-Proto $scheme;\n"
        )
    };
    let location = format!("    location / {{\n{}    }}\n", proxy(&vhost.upstream()));
    // The HTTP-01 answers of this host's acme capability, for the names it serves: a
    // file there is served, any other path under it goes where it would without them.
    let challenge = |fallback: &str| {
        config.acme_webroot.as_ref().map(|root| {
            format!(
                "    location ^~ /.well-known/acme-challenge/ {{\n        root {};\n        \
                 try_files $uri {fallback};\n    }}\n",
                root.display()
            )
        })
    };
    match vhost.tls.as_deref().and_then(|t| config.tls.get(t)) {
        None => {
            out.push_str("server {\n");
            for l in &config.listen {
                out.push_str(&format!("    listen {l};\n"));
            }
            out.push_str(&format!("    server_name {names};\n"));
            out.push_str(&location);
            if let Some(c) = challenge("@fort_upstream") {
                out.push_str(&c);
                // A named location forwards the request as it came (no path of its own).
                let bare = format!("http://{}:{}", vhost.upstream_host, vhost.port);
                out.push_str(&format!(
                    "    location @fort_upstream {{\n{}    }}\n",
                    proxy(&bare)
                ));
            }
            out.push_str("}\n");
        }
        Some(set) => {
            out.push_str("server {\n");
            for l in &config.listen_tls {
                out.push_str(&format!("    listen {l} ssl;\n"));
            }
            out.push_str(&format!("    server_name {names};\n"));
            out.push_str(&format!(
                "    ssl_certificate {};\n    ssl_certificate_key {};\n",
                set.certificate.display(),
                set.key.display()
            ));
            out.push_str(&location);
            out.push_str("}\nserver {\n");
            for l in &config.listen {
                out.push_str(&format!("    listen {l};\n"));
            }
            out.push_str(&format!("    server_name {names};\n"));
            let redirect = "return 301 https://$host$request_uri;";
            match challenge("@fort_https") {
                None => out.push_str(&format!("    {redirect}\n}}\n")),
                Some(c) => {
                    // The redirect moves into locations: at the server level it would
                    // answer before the challenge location is looked at.
                    out.push_str(&c);
                    out.push_str(&format!(
                        "    location / {{\n        {redirect}\n    }}\n    \
                         location @fort_https {{\n        {redirect}\n    }}\n}}\n"
                    ));
                }
            }
        }
    }
    out
}

/// The request a vhost file this handler wrote answers, read back from its lines
/// (`server_name`, `proxy_pass`, `ssl_certificate`), for checking it against today's
/// config; `None` when the file is not in the form `render` writes.
pub fn read_back(config: &Config, text: &str) -> Option<serde_json::Value> {
    let value = |directive: &str| {
        text.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(directive)?.strip_suffix(';'))
    };
    let names: Vec<&str> = value("server_name ")?.split(' ').collect();
    let upstream = value("proxy_pass http://")?;
    let (authority, path) = match upstream.find('/') {
        Some(i) => (&upstream[..i], Some(&upstream[i..])),
        None => (upstream, None),
    };
    let (host, port) = authority.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let tls = match value("ssl_certificate ") {
        None => None,
        Some(path) => Some(
            config
                .tls
                .iter()
                .find(|(_, set)| set.certificate.to_str() == Some(path))
                .map(|(name, _)| name.clone())?,
        ),
    };
    Some(serde_json::json!({
        "server_names": names,
        "port": port,
        "path": path,
        "upstream_host": host,
        "tls": tls,
    }))
}

/// The digest the state keeps of a file's content.
pub fn digest(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::parse_input;
    use serde_json::json;

    #[test]
    fn names_markers_and_text() {
        let entries = parse_input(
            br#"{"app:proxy/wiki":{"request":{}},"a.b:proxy/x":{"request":{}},"A:proxy/x":{"request":{}}}"#,
        )
        .unwrap();
        let names: Vec<Option<String>> = entries.iter().map(file_name).collect();
        assert_eq!(names, [None, None, Some("fort.app.proxy.wiki.conf".into())]);
        let config: Config = serde_json::from_value(json!({
            "include_dir": "/d", "state_file": "/s", "listen": ["127.0.0.1:8080"],
            "tls": {"t": {"certificate": "/c.pem", "key": "/k.pem"}}}))
        .unwrap();
        let vhost = Vhost {
            server_names: vec!["a.example.org".into(), "b.example.org".into()],
            upstream_host: "10.0.0.3".into(),
            port: 3000,
            path: None,
            tls: None,
        };
        let text = render(&config, "app:proxy/wiki", &vhost);
        assert!(has_marker(&text, Some("app:proxy/wiki")));
        assert!(!has_marker(&text, Some("app:proxy/wik")));
        assert!(text.contains(
            "    listen 127.0.0.1:8080;\n    server_name a.example.org b.example.org;\n"
        ));
        assert!(text.contains("proxy_pass http://10.0.0.3:3000;"));
        let tls = render(
            &config,
            "k",
            &Vhost {
                tls: Some("t".into()),
                ..vhost.clone()
            },
        );
        assert!(tls.contains("listen 443 ssl;") && tls.contains("ssl_certificate_key /k.pem;"));
        assert!(tls.contains("return 301"));
        assert_eq!(digest("x").len(), 64);
        // What a file answers reads back into the request that renders it again.
        for v in [
            &vhost,
            &Vhost {
                tls: Some("t".into()),
                path: Some("/wiki/".into()),
                upstream_host: "[fd00::3]".into(),
                ..vhost.clone()
            },
        ] {
            let text = render(&config, "k", v);
            let request = read_back(&config, &text).unwrap();
            let again = crate::proxy::request::resolve(
                &config,
                "app",
                &["*.example.org".to_owned()],
                Some(&v.upstream_host),
                &request,
            )
            .unwrap();
            assert_eq!(render(&config, "k", &again), text);
        }
        assert_eq!(read_back(&config, "# not ours\n"), None);
    }
}
