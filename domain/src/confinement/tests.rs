use super::*;
use std::collections::BTreeMap;

fn tenant(s: &str) -> TenantId {
    TenantId::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Data dir `/srv/ferry`, tenant folders under `/srv/tenants/{tenant}`, the default
/// env and Vault prefixes, one allowed Git host per tenant and a shared config host.
fn settings() -> ConfinementSettings {
    ConfinementSettings {
        ferry: FerryFiles {
            data_dir: "/srv/ferry".into(),
            config_file: Some("/etc/ferry/ferry.toml".into()),
            policy_dir: Some("/etc/ferry/policies".into()),
            artifacts_dir: None,
            secret_files: vec![("/etc/nats/ferry.creds".into(), "NATS credentials")],
        },
        file_roots: strings(&["/srv/tenants/{tenant}", "/srv/shared"]),
        program_roots: strings(&["/srv/tenants/{tenant}/repos"]),
        env_prefix: "TENANT_{tenant}".into(),
        vault_prefix: "{tenant}/".into(),
        program_url_prefixes: strings(&["https://git.example.com/{tenant}/"]),
        config_url_prefixes: strings(&["https://config.example.com/{tenant}"]),
        probe_url_prefixes: None,
        trusted_programs: vec![(
            ProgramRef::parse("/opt/baselines#base").unwrap_or_else(|e| panic!("{e}")),
            ProgramVersion::parse("abcdef1").unwrap_or_else(|e| panic!("{e}")),
        )],
    }
}

fn rules() -> Confinement {
    Confinement::new(settings()).unwrap_or_else(|e| panic!("{e}"))
}

fn secret(s: &str) -> SecretRef {
    SecretRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn config(s: &str) -> ConfigRef {
    ConfigRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn program(s: &str) -> ProgramRef {
    ProgramRef::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn commit(s: &str) -> ProgramVersion {
    ProgramVersion::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn refused_setting(e: ConfinementError) -> Setting {
    match e {
        ConfinementError::Setting { setting, .. } => setting,
        other => panic!("unexpected {other:?}"),
    }
}

/// Every tenant id of up to three characters over an alphabet with each kind of character.
fn small_tenants() -> Vec<TenantId> {
    let alphabet = ['a', 'A', '0', '_', '.', '-', ':'];
    let mut ids: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
    let mut last = ids.clone();
    for _ in 0..2 {
        let next: Vec<String> = last
            .iter()
            .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
            .collect();
        ids.extend(next.iter().cloned());
        last = next;
    }
    ids.iter().map(|s| tenant(s)).collect()
}

#[test]
fn the_env_encoding_is_injective_and_prefix_free() {
    let tenants = small_tenants();
    assert_eq!(tenants.len(), 7 + 49 + 343);
    let encoded: Vec<String> = tenants.iter().map(env_component).collect();
    for (i, a) in encoded.iter().enumerate() {
        assert!(
            a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{a}"
        );
        for (j, b) in encoded.iter().enumerate() {
            if i != j {
                // Not equal, and not a prefix: whatever name follows, no two tenants meet.
                assert!(
                    !b.starts_with(a.as_str()),
                    "{} ({a}) reaches {} ({b})",
                    tenants[i],
                    tenants[j]
                );
            }
        }
    }
    assert_eq!(env_component(&tenant("acme")), "acme__");
    assert_eq!(env_component(&tenant("acme_x")), "acme_5Fx__");
    assert_eq!(env_component(&tenant("acme-x")), "acme_2Dx__");
    assert_eq!(env_component(&tenant("Acme")), "Acme__", "case-sensitive");
}

#[test]
fn a_tenant_reaches_only_its_own_variables() {
    let rules = rules();
    let acme = tenant("acme");
    assert_eq!(rules.env_prefix(&acme), "TENANT_acme__");
    assert!(rules
        .check_secret(&acme, &secret("env://TENANT_acme__DB_PASSWORD"))
        .is_ok());
    for other in ["acme_x", "acme-x", "acme.x", "acme:x", "Acme", "acm"] {
        let theirs = format!("env://{}DB_PASSWORD", rules.env_prefix(&tenant(other)));
        let err = rules.check_secret(&acme, &secret(&theirs)).unwrap_err();
        assert!(
            matches!(err, Refusal::OutsideEnvPrefix { .. }),
            "{other}: {err}"
        );
        assert!(err.to_string().contains("FERRY_TENANT_ENV_PREFIX"), "{err}");
        // And the other way round.
        let ours = secret("env://TENANT_acme__DB_PASSWORD");
        assert!(
            rules.check_secret(&tenant(other), &ours).is_err(),
            "{other}"
        );
    }
    // The prefix alone names no variable.
    assert!(rules
        .check_secret(&acme, &secret("env://TENANT_acme__"))
        .is_err());
}

#[test]
fn reserved_variables_are_never_resolvable() {
    // Even when the prefix would allow them: a tenant whose prefix starts like them.
    let mut s = settings();
    s.env_prefix = "{tenant}".into();
    let shared = Confinement::new(s).unwrap_or_else(|e| panic!("{e}"));
    let ferry = tenant("FERRY");
    assert!(shared
        .check_secret(&ferry, &secret("env://FERRY__X"))
        .is_err());
    for name in [
        "DATABASE_URL",
        "FERRY_JWT_HS256_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "NATS_URL",
        "PULUMI_ACCESS_TOKEN",
        "AZURE_CLIENT_SECRET",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "VAULT_TOKEN",
        "PGPASSWORD",
        "ferry_lowercase",
    ] {
        assert!(is_reserved_variable(name), "{name}");
        let err = rules()
            .check_secret(&tenant("acme"), &secret(&format!("env://{name}")))
            .unwrap_err();
        assert!(
            matches!(err, Refusal::ReservedVariable { .. }),
            "{name}: {err}"
        );
    }
    assert!(!is_reserved_variable("TENANT_acme__DB"));
}

#[test]
fn files_are_confined_to_the_tenants_roots() {
    let rules = rules();
    let acme = tenant("acme");
    let ok = |s: &str| rules.check_secret(&acme, &secret(s));
    assert!(ok("file:///srv/tenants/acme/db").is_ok());
    assert!(ok("file:///srv/tenants/acme/./nested//db").is_ok());
    assert!(ok("file:///srv/shared/ca.pem").is_ok(), "a shared root");
    // Component boundaries: /srv/tenants/acme does not contain /srv/tenants/acmex.
    let err = ok("file:///srv/tenants/acmex/db").unwrap_err();
    assert!(matches!(err, Refusal::OutsideRoots { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("FERRY_TENANT_FILE_ROOTS: /srv/tenants/acme, /srv/shared"),
        "{err}"
    );
    assert!(ok("file:///srv/tenants/globex/db").is_err());
    assert!(ok("file:///srv/sharedx/db").is_err());
    // `..` is refused, never resolved.
    let err = ok("file:///srv/tenants/acme/../globex/db").unwrap_err();
    assert!(matches!(err, Refusal::Malformed(_)), "{err}");
    assert!(err.to_string().contains("'..'"), "{err}");
    // Configuration files follow the same roots.
    assert!(rules
        .check_config(&acme, &config("file:///srv/tenants/acme/app.yaml"))
        .is_ok());
    assert!(rules
        .check_config(&acme, &config("file:///etc/passwd"))
        .is_err());
}

#[test]
fn ferrys_own_files_are_never_resolvable() {
    let rules = rules();
    let acme = tenant("acme");
    for (path, what) in [
        ("/srv/ferry/jwt-hs256.key", "token signing key"),
        (
            "/srv/ferry/secret-fingerprint.key",
            "secret fingerprint key",
        ),
        ("/srv/ferry/ferry.db", "embedded database"),
        ("/srv/ferry/ferry.db-wal", "embedded database"),
        ("/srv/ferry/git-cache/globex/x", "Git cache"),
        ("/etc/ferry/ferry.toml", "configuration file"),
        ("/etc/ferry/policies/x.rego", "policy folder"),
        ("/etc/nats/ferry.creds", "NATS credentials"),
    ] {
        let err = rules
            .check_secret(&acme, &secret(&format!("file://{path}")))
            .unwrap_err();
        assert_eq!(
            err,
            Refusal::FerryFile {
                path: path.to_string(),
                what
            }
        );
    }
    // Also as a real path, in its configured or its resolved form.
    let canonical = |p: &Path| Some(Path::new("/real").join(p.strip_prefix("/").ok()?));
    for real in ["/srv/ferry/jwt-hs256.key", "/real/srv/ferry/jwt-hs256.key"] {
        let err = rules
            .check_real_path(&acme, Path::new(real), Some(RootKind::Files), canonical)
            .unwrap_err();
        assert!(matches!(err, Refusal::FerryFile { .. }), "{real}: {err}");
    }
    // Real paths are checked against the resolved roots.
    assert!(rules
        .check_real_path(
            &acme,
            Path::new("/real/srv/tenants/acme/db"),
            Some(RootKind::Files),
            canonical
        )
        .is_ok());
    let err = rules
        .check_real_path(
            &acme,
            Path::new("/real/srv/tenants/globex/db"),
            Some(RootKind::Files),
            canonical,
        )
        .unwrap_err();
    assert!(matches!(err, Refusal::OutsideRoots { .. }), "{err}");
}

#[test]
fn roots_that_could_hold_ferrys_files_are_refused() {
    for (roots, why) in [
        (vec!["/srv"], "holds the data dir"),
        (
            vec!["/srv/{tenant}"],
            "tenant 'ferry' would be the data dir",
        ),
        (vec!["/srv/ferry"], "is the data dir"),
        (vec!["/srv/ferry/work/{tenant}"], "lies in the work folder"),
        (
            vec!["/etc/ferry/policies/{tenant}"],
            "lies in the policy folder",
        ),
        (vec!["/etc"], "holds the configuration file"),
        (vec!["/etc/nats"], "holds Ferry's NATS credentials"),
        (vec!["/"], "the file system root"),
        (vec!["relative/{tenant}"], "relative"),
        (vec!["/srv/tenants/../ferry"], "climbs"),
        (vec!["/srv/{tenant"], "a broken placeholder"),
    ] {
        let mut s = settings();
        s.file_roots = strings(&roots);
        let err = Confinement::new(s.clone()).unwrap_err();
        assert!(
            err.to_string().starts_with("FERRY_TENANT_FILE_ROOTS: "),
            "{err}"
        );
        assert_eq!(refused_setting(err), Setting::FileRoots, "{why}");
        s.file_roots = vec![];
        s.program_roots = strings(&roots);
        let err = Confinement::new(s).unwrap_err();
        assert_eq!(refused_setting(err), Setting::ProgramRoots, "{why}");
    }
    // The embedded default: tenant folders inside the data dir, apart from Ferry's files.
    let mut s = settings();
    s.file_roots = strings(&["/srv/ferry/tenants/{tenant}"]);
    assert!(Confinement::new(s).is_ok());
}

#[test]
fn prefix_settings_are_validated() {
    for prefix in ["FERRY_{tenant}", "AWS_", "", "TENANT-{tenant}", "{tenant"] {
        let mut s = settings();
        s.env_prefix = prefix.into();
        assert_eq!(
            refused_setting(Confinement::new(s).unwrap_err()),
            Setting::EnvPrefix,
            "{prefix}"
        );
    }
    for prefix in ["../{tenant}/", "kv//{tenant}/", "/{tenant}/", "kv/%2e/"] {
        let mut s = settings();
        s.vault_prefix = prefix.into();
        assert_eq!(
            refused_setting(Confinement::new(s).unwrap_err()),
            Setting::VaultPrefix,
            "{prefix}"
        );
    }
    for prefix in ["ftp://x/", "https:///x", "https://x/a/../b", "https://x/?a"] {
        let mut s = settings();
        s.program_url_prefixes = strings(&[prefix]);
        assert_eq!(
            refused_setting(Confinement::new(s).unwrap_err()),
            Setting::ProgramUrlPrefixes,
            "{prefix}"
        );
    }
    let mut s = settings();
    s.config_url_prefixes = strings(&["ssh://x/"]);
    assert_eq!(
        refused_setting(Confinement::new(s).unwrap_err()),
        Setting::ConfigUrlPrefixes
    );
}

#[test]
fn vault_paths_are_confined_to_the_tenants_prefix() {
    let rules = rules();
    let acme = tenant("acme");
    assert_eq!(rules.vault_prefix(&acme), "acme/");
    assert!(rules
        .check_secret(&acme, &secret("vault://acme/payments/db#password"))
        .is_ok());
    for other in [
        "vault://globex/payments/db#password",
        "vault://acmex/payments/db#password",
        "vault://kv/acme/db#password",
    ] {
        let err = rules.check_secret(&acme, &secret(other)).unwrap_err();
        assert!(matches!(err, Refusal::OutsideVaultPrefix { .. }), "{err}");
        assert!(
            err.to_string().contains("FERRY_TENANT_VAULT_PREFIX"),
            "{err}"
        );
    }
    for climbing in [
        "vault://acme/../globex/db#password",
        "vault://acme/./db#password",
        "vault://acme/%2E%2E/db#password",
        "vault://acme//db#password",
    ] {
        let err = rules.check_secret(&acme, &secret(climbing)).unwrap_err();
        assert!(matches!(err, Refusal::Malformed(_)), "{climbing}: {err}");
    }
    // A tenant whose id is `..` gets a prefix no reference can have.
    assert!(rules
        .check_secret(&tenant(".."), &secret("vault://../x/db#k"))
        .is_err());
}

#[test]
fn urls_are_confined_to_the_allowed_prefixes() {
    let rules = rules();
    let acme = tenant("acme");
    let git = |s: &str| rules.check_program(&acme, &program(s), &commit("abcdef2"));
    assert!(git("https://git.example.com/acme/infra.git#stacks/web").is_ok());
    assert!(
        git("https://GIT.example.com/acme/infra.git").is_ok(),
        "hosts are case-insensitive"
    );
    for refused in [
        "https://git.example.com/globex/infra.git",
        "https://git.example.com/acmex/infra.git",
        "https://git.example.com/acme",
        "https://git.example.com@evil.example/acme/infra.git",
        "https://git.example.com.evil.example/acme/infra.git",
        "http://git.example.com/acme/infra.git",
        "ssh://git.example.com/acme/infra.git",
    ] {
        let err = git(refused).unwrap_err();
        assert!(
            matches!(err, Refusal::UrlNotAllowed { .. }),
            "{refused}: {err}"
        );
        assert!(
            err.to_string()
                .contains("FERRY_TENANT_PROGRAM_URL_PREFIXES"),
            "{err}"
        );
    }
    for climbing in [
        "https://git.example.com/acme/../globex/infra.git",
        "https://git.example.com/acme/%2e%2e/globex/infra.git",
        "https://git.example.com/acme/..%2Fglobex/infra.git",
    ] {
        assert!(
            matches!(git(climbing), Err(Refusal::Malformed(_))),
            "{climbing}"
        );
    }
    // Prefix without a trailing slash: a boundary after it.
    let cfg = |s: &str| rules.check_config(&acme, &config(s));
    assert!(cfg("https://config.example.com/acme").is_ok());
    assert!(cfg("https://config.example.com/acme/app.json?v=2").is_ok());
    assert!(cfg("https://config.example.com/acme-evil/app.json").is_err());
    // None configured: the message says which setting to set.
    let mut s = settings();
    s.config_url_prefixes = vec![];
    let err = Confinement::new(s)
        .unwrap_or_else(|e| panic!("{e}"))
        .check_config(&acme, &config("https://config.example.com/acme"))
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "(FERRY_TENANT_CONFIG_URL_PREFIXES: none configured); set it to allow remote sources"
        ),
        "{err}"
    );
}

#[test]
fn local_programs_are_confined_to_the_program_roots() {
    let rules = rules();
    let acme = tenant("acme");
    let v = commit("abcdef2");
    let check = |s: &str, v: &ProgramVersion| rules.check_program(&acme, &program(s), v);
    assert!(check("/srv/tenants/acme/repos/infra#web", &v).is_ok());
    assert!(check("file:///srv/tenants/acme/repos/infra#web", &v).is_ok());
    assert!(check("file://localhost/srv/tenants/acme/repos/infra", &v).is_ok());
    let err = check("/etc#", &v).unwrap_err();
    assert!(matches!(err, Refusal::OutsideRoots { .. }), "{err}");
    assert!(
        err.to_string().contains("FERRY_TENANT_PROGRAM_ROOTS"),
        "{err}"
    );
    assert!(check("/srv/tenants/globex/repos/infra", &v).is_err());
    assert!(
        check("/srv/tenants/acme/infra", &v).is_err(),
        "file roots are not program roots"
    );
    assert!(matches!(
        check("./infra#web", &v),
        Err(Refusal::Malformed(_))
    ));
    assert!(matches!(
        check("/srv/tenants/acme/repos/infra#../../x", &v),
        Err(Refusal::Malformed(_))
    ));
    // The operator's baseline: exactly that program at exactly that commit.
    assert!(check("/opt/baselines#base", &commit("abcdef1")).is_ok());
    assert!(check("/opt/baselines#base", &v).is_err());
    assert!(check("/opt/baselines#other", &commit("abcdef1")).is_err());
    let baseline = BaselineProgram {
        program_ref: program("/opt/baselines#base"),
        program_version: commit("abcdef1"),
    };
    assert!(rules.check_baseline_program(&acme, &baseline).is_ok());
}

#[test]
fn a_declaration_names_each_refused_field() {
    let rules = rules();
    let err = rules
        .check_specification(
            &tenant("acme"),
            &program("/etc#"),
            &commit("abcdef2"),
            &BTreeMap::from([("app".to_string(), config("file:///etc/ferry/ferry.toml"))]),
            &BTreeMap::from([
                ("ok".to_string(), secret("env://TENANT_acme__OK")),
                ("db".to_string(), secret("env://DATABASE_URL")),
                ("key".to_string(), secret("file:///srv/ferry/jwt-hs256.key")),
            ]),
        )
        .unwrap_err();
    let fields: Vec<&str> = err.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "programRef",
            "configRefs.app",
            "secretRefs.db",
            "secretRefs.key"
        ]
    );
    assert!(
        err[1].to_string().contains("configuration file"),
        "{}",
        err[1]
    );
}

#[test]
fn odd_tenant_ids_stay_in_their_folders() {
    let rules = rules();
    let dots = tenant("..");
    assert_eq!(
        rules.roots(&dots, RootKind::Files),
        [
            PathBuf::from("/srv/tenants/%2E%2E"),
            PathBuf::from("/srv/shared")
        ]
    );
    assert!(rules
        .check_secret(&dots, &secret("file:///srv/tenants/acme/db"))
        .is_err());
}

#[test]
fn probe_urls_are_free_until_the_operator_sets_prefixes_then_stay_in_the_tenant_s() {
    let url = |s: &str| ProbeUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
    assert!(rules()
        .check_probe(
            &tenant("acme"),
            &url("https://payments.example.com/healthz")
        )
        .is_ok());
    assert!(rules()
        .check_probe(&tenant("acme"), &url("http://8.8.8.8:9000/admin"))
        .is_ok());
    let mut s = settings();
    s.probe_url_prefixes = Some(strings(&["https://{tenant}.apps.example.com/"]));
    let rules = Confinement::new(s).unwrap_or_else(|e| panic!("{e}"));
    assert!(rules
        .check_probe(
            &tenant("acme"),
            &url("https://acme.apps.example.com/healthz")
        )
        .is_ok());
    for (who, probe) in [
        ("acme", "https://globex.apps.example.com/healthz"),
        ("acme", "http://10.0.0.7:9000/admin"),
        ("acme", "https://acme.apps.example.com.evil.io/healthz"),
        ("acme", "https://acme.apps.example.com/a/../../x"),
        ("globex", "https://acme.apps.example.com/healthz"),
    ] {
        assert!(
            rules.check_probe(&tenant(who), &url(probe)).is_err(),
            "{who} may not probe {probe}"
        );
    }
    let mut bad = settings();
    bad.probe_url_prefixes = Some(strings(&["ftp://x/"]));
    assert!(matches!(
        Confinement::new(bad),
        Err(ConfinementError::Setting {
            setting: Setting::ProbeUrlPrefixes,
            ..
        })
    ));
}

#[test]
fn probes_reach_no_non_public_address_however_written_unless_a_prefix_names_it() {
    let url = |s: &str| ProbeUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
    let acme = tenant("acme");
    // By default (no prefixes): Ferry's own port, the metadata service, private networks,
    // in every form the HTTP client reads as one of them.
    for probe in [
        "http://127.0.0.1:8080/metrics",
        "http://127.1:8080/metrics",
        "http://2130706433:8080/metrics",
        "http://0x7f.1:8080/metrics",
        "http://0177.0.0.1:8080/metrics",
        "http://0x7f000001:8080/metrics",
        "http://[::1]:8080/metrics",
        "http://[::ffff:127.0.0.1]:8080/metrics",
        "http://[::ffff:7f00:1]:8080/metrics",
        "http://[0:0:0:0:0:ffff:127.0.0.1]:8080/",
        "http://[::127.0.0.1]:8080/",
        "http://0.0.0.0:8080/metrics",
        "http://0:8080/metrics",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fe80::1]/",
        "http://[fd00::1]/",
        "http://10.0.0.7:9000/admin",
        "http://172.16.3.4/",
        "http://192.168.0.1/",
        "http://100.64.0.1/",
        "http://224.0.0.1/",
        "http://255.255.255.255/",
        "http://localhost:8080/metrics",
        "http://LOCALHOST.:8080/metrics",
        "http://ferry.localhost/metrics",
    ] {
        match rules().check_probe(&acme, &url(probe)) {
            Err(Refusal::NonPublicAddress { setting, .. }) => {
                assert_eq!(setting, Setting::ProbeUrlPrefixes, "{probe}")
            }
            other => panic!("{probe} must be refused as non-public, got {other:?}"),
        }
    }
    // A prefix naming the address allows it, for the tenants it is configured for, and
    // only that address.
    let mut s = settings();
    s.probe_url_prefixes = Some(strings(&[
        "http://127.0.0.1:8080/",
        "http://[::1]:9090/",
        "https://{tenant}.apps.example.com/",
    ]));
    let rules = Confinement::new(s).unwrap_or_else(|e| panic!("{e}"));
    for probe in [
        "http://127.0.0.1:8080/healthz",
        "http://[::1]:9090/smoke",
        "https://acme.apps.example.com/healthz",
    ] {
        assert_eq!(rules.check_probe(&acme, &url(probe)), Ok(()), "{probe}");
    }
    for probe in [
        "http://127.0.0.1:8081/metrics",
        "http://2130706433:8080/metrics",
        "http://localhost:8080/metrics",
        "http://10.0.0.7:8080/",
    ] {
        assert!(rules.check_probe(&acme, &url(probe)).is_err(), "{probe}");
    }
}
