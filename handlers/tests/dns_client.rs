//! The RFC 2136 client on its own (`fort_handlers::dns`), as ACME DNS-01 validation uses
//! it: TXT values set beside others at `_acme-challenge.<domain>`, each deleted alone, and
//! the primary asked whether it answers one; against knotd and named on loopback.

use std::time::Duration;

use fort_handlers::dns::{Algorithm, DnsName, Outcome, Primary, Server, TsigKey};
use fort_tests::dns::{DnsServer, Flavor};

#[tokio::test]
async fn knot() {
    txt_challenges(Flavor::Knot).await;
}

#[tokio::test]
async fn bind() {
    txt_challenges(Flavor::Bind).await;
}

fn server_of(s: &DnsServer, secret: Vec<u8>) -> Server {
    Server {
        addr: s.addr,
        zone: DnsName::parse(&s.zone).unwrap(),
        key: TsigKey::from_secret(
            DnsName::parse(&s.key_name).unwrap(),
            Algorithm::HmacSha256,
            secret,
        ),
        timeout: Duration::from_secs(5),
    }
}

async fn txt_challenges(flavor: Flavor) {
    let records = "_acme-challenge.www IN TXT \"made by hand\"\ncname IN CNAME www.example.test.\n";
    let s = match DnsServer::start(flavor, "example.test", records) {
        Ok(s) => s,
        Err(why) => return fort_tests::skip(&format!("dns_client ({})", flavor.name()), &why),
    };
    let key_path = s.dir.path().join("key");
    s.write_key(&key_path);
    let key = TsigKey::load(&s.key_name, Algorithm::HmacSha256, &key_path).unwrap();
    let server = Server {
        key,
        ..server_of(&s, vec![0; 32])
    };
    let primary = Primary::connect(&server).await.unwrap();
    let name = DnsName::parse("_acme-challenge.www.example.test").unwrap();
    let (a, b) = ("token-for-www".to_owned(), "token-for-wildcard".to_owned());

    assert!(!primary.answers_txt(&name, &a).await.unwrap());
    assert_eq!(
        primary
            .set_txt(&name, std::slice::from_ref(&a), 60)
            .await
            .unwrap(),
        Outcome::Applied
    );
    assert_eq!(
        primary
            .set_txt(&name, std::slice::from_ref(&b), 60)
            .await
            .unwrap(),
        Outcome::Applied
    );
    assert!(primary.answers_txt(&name, &a).await.unwrap());
    assert_eq!(
        s.dig("_acme-challenge.www.example.test", "TXT"),
        [
            r#""made by hand""#,
            r#""token-for-wildcard""#,
            r#""token-for-www""#
        ]
    );

    // Exactly one value goes; the other challenge and the hand-made value stay.
    assert_eq!(
        primary.delete_txt(&name, &a).await.unwrap(),
        Outcome::Applied
    );
    assert!(!primary.answers_txt(&name, &a).await.unwrap());
    assert!(primary.answers_txt(&name, &b).await.unwrap());
    assert_eq!(
        s.dig("_acme-challenge.www.example.test", "TXT"),
        [r#""made by hand""#, r#""token-for-wildcard""#]
    );

    // A TXT value is never added beside a CNAME; a name outside the zone is not sent.
    let cname = DnsName::parse("cname.example.test").unwrap();
    assert!(matches!(
        primary
            .set_txt(&cname, std::slice::from_ref(&a), 60)
            .await
            .unwrap(),
        Outcome::Rejected(_)
    ));
    let outside = DnsName::parse("_acme-challenge.example.org").unwrap();
    let Outcome::Rejected(why) = primary
        .set_txt(&outside, std::slice::from_ref(&a), 60)
        .await
        .unwrap()
    else {
        panic!("a name outside the zone was accepted");
    };
    assert!(why.contains("not in the zone"), "{why}");
    // A value that is not printable ASCII is an error before anything is sent.
    assert!(primary
        .set_txt(&name, &["a\nb".to_owned()], 60)
        .await
        .is_err());

    // Another secret under the same key name: the primary refuses it, and it is an error.
    let wrong = Primary::connect(&server_of(&s, vec![7; 32])).await.unwrap();
    let e = wrong
        .set_txt(&name, std::slice::from_ref(&a), 60)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("NOTAUTH"), "{e}");
    assert!(!primary.answers_txt(&name, &a).await.unwrap());
}
