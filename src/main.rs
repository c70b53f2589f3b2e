//! The `ferry` command: serve the API, run migrations, inspect and rebuild projections,
//! print tokens for the embedded key, and write the published schemas.
#![forbid(unsafe_code)]

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use ferry_app::server::{init_tracing, open_database};
use ferry_app::{Config, Contexts, Server};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

// Ferry allocates many small, short-lived values (decoded events, JSON documents) on one
// thread and frees them on another; mimalloc does that with far less contention than the
// system allocator (measured in bench/README.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Delivery and provisioning control plane"
)]
struct Cli {
    /// TOML configuration file (also FERRY_CONFIG); FERRY_* variables override it.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP API, the console and the projections (migrates first).
    Serve {
        /// Record a demo tenant to look at in the console (embedded default, empty data dir
        /// only) and print one-time sign-in links.
        #[arg(long)]
        demo: bool,
    },
    /// Apply the database migrations and create the read-model tables.
    Migrate,
    /// Inspect or rebuild the read models.
    Projections {
        #[command(subcommand)]
        command: ProjectionsCommand,
    },
    /// Print a bearer token signed with the configured (or embedded) HS256 key.
    Token {
        /// The tenant the token acts for.
        #[arg(long)]
        tenant: String,
        /// The subject (who the caller is).
        #[arg(long)]
        sub: String,
        /// Space-separated scopes: factory.provisioning.read, factory.provisioning.apply
        /// (people), or factory.events.publish (a service posting other services' events).
        #[arg(long, default_value = "")]
        scopes: String,
        /// Space-separated roles of a person: Operator, PlatformAdmin, Observer, Reviewer,
        /// WorkspaceAdmin (none for a service).
        #[arg(long, default_value = "")]
        roles: String,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
    },
    /// Re-plan environments now: a Reconciliation run of each applied specification (the
    /// workers of a running `ferry serve` plan them); prints the runs and what was skipped.
    Reconcile {
        /// Only this tenant's environments (every tenant's when absent).
        #[arg(long)]
        tenant: Option<String>,
        /// Only this environment (needs --tenant).
        #[arg(long)]
        environment: Option<String>,
        /// Reconcile this window (a scheduled one, e.g. `2026-12-03T12:00Z`, that was missed)
        /// as the leader: every instance that reconciles a window meets on the same runs.
        /// Without it, the pass is a window of its own.
        #[arg(long)]
        window: Option<String>,
    },
    /// Operate the NATS relay.
    Relay {
        #[command(subcommand)]
        command: RelayCommand,
    },
    /// Write the OpenAPI document (and other published schemas) to a folder, and the
    /// configuration table into docs/configuration.md beside that folder.
    Schemas {
        /// Where to write.
        #[arg(long, default_value = "schemas")]
        out: PathBuf,
        /// Only check that the files are up to date; fail if not.
        #[arg(long)]
        check: bool,
    },
}

#[derive(Subcommand)]
enum RelayCommand {
    /// Publish every event after a position again (e.g. after a reported stream reset);
    /// a running relay picks it up. Positions are `ferry projections status`'s
    /// (`<transaction>.<position>`, or `0` for the beginning).
    Replay {
        /// Republish the events after this position.
        #[arg(long)]
        after: String,
    },
}

#[derive(Subcommand)]
enum ProjectionsCommand {
    /// Each subscription's position and lag.
    Status,
    /// Replay the stream into fresh tables and swap them in (all, or the named one, e.g.
    /// runs; an unknown name is refused with the list). Safe while `ferry serve` runs.
    Rebuild {
        /// The projection; all when absent.
        name: Option<String>,
    },
}

fn out(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.write_all(b"\n")?;
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let config = match Config::load(cli.config.as_deref(), &env) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "ferry: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    init_tracing(&config);
    match run(cli.command, config).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "ferry: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Serve { demo: false } => {
            let server = Server::start(&config).await?;
            server.run_until_signal(&std::env::vars().collect()).await;
        }
        Command::Serve { demo: true } => {
            let config = ferry_app::demo::prepare(config)?;
            let server = Server::start(&config).await?;
            out("ferry: recording the demo (about a minute)…")?;
            let made = match ferry_app::demo::seed(&config).await {
                Ok(made) => made,
                Err(e) => {
                    server.stop().await;
                    return Err(e.into());
                }
            };
            out(&format!("ferry: the demo is ready: open {}", made.console))?;
            for (who, role, link) in &made.links {
                out(&format!("  sign in as {who} ({role}): {link}"))?;
            }
            server.run_until_signal(&std::env::vars().collect()).await;
        }
        Command::Migrate => {
            let db = open_database(&config).await?;
            db.close().await;
            out("migrations applied")?;
        }
        Command::Relay {
            command: RelayCommand::Replay { after },
        } => replay(&config, &after).await?,
        Command::Reconcile {
            tenant,
            environment,
            window,
        } => reconcile(&config, tenant, environment, window).await?,
        Command::Projections { command } => projections(&config, command).await?,
        Command::Token {
            tenant,
            sub,
            scopes,
            roles,
            ttl,
        } => token(&config, &tenant, &sub, &scopes, &roles, ttl)?,
        Command::Schemas { out: dir, check } => {
            let mut stale = Vec::new();
            for (name, text) in Contexts::builtin().published_schemas()? {
                let path = dir.join(name);
                if check {
                    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                        stale.push(path.display().to_string());
                    }
                } else {
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent)?;
                    }
                    std::fs::write(&path, text)
                        .with_context(|| format!("writing {}", path.display()))?;
                    out(&format!("wrote {}", path.display()))?;
                }
            }
            // docs/configuration.md beside the schemas folder (as in the repository) carries
            // the configuration table; a folder elsewhere has none to keep.
            let readme = dir
                .parent()
                .unwrap_or(std::path::Path::new(""))
                .join("docs/configuration.md");
            let current = std::fs::read_to_string(&readme).unwrap_or_default();
            let fresh = ferry_app::config::with_markdown_table(&current);
            if let Some(fresh) = fresh.filter(|fresh| *fresh != current) {
                if check {
                    stale.push(readme.display().to_string());
                } else {
                    std::fs::write(&readme, fresh)
                        .with_context(|| format!("writing {}", readme.display()))?;
                    out(&format!("wrote {}", readme.display()))?;
                }
            }
            if !stale.is_empty() {
                bail!("stale: {} (run `ferry schemas`)", stale.join(", "));
            }
        }
    }
    Ok(())
}

/// `ferry relay replay --after <position>`.
async fn replay(config: &Config, after: &str) -> anyhow::Result<()> {
    let Some(position) = ferry_messaging::parse_position(after) else {
        bail!("--after {after:?} is not a position (`<transaction>.<position>` or a number)");
    };
    let db = open_database(config).await?;
    let events = ferry_messaging::relay::replay_after(&db, &config.nats_stream, position).await;
    db.close().await;
    out(&format!(
        "the relay to {} will publish {} events again",
        config.nats_stream, events?
    ))?;
    Ok(())
}

/// `ferry reconcile`: a reconciliation pass now (as the leader of `window` when given).
async fn reconcile(
    config: &Config,
    tenant: Option<String>,
    environment: Option<String>,
    window: Option<String>,
) -> anyhow::Result<()> {
    use ferry_app::contexts::provisioning::reconcile;
    let tenant = tenant
        .map(ferry_domain::TenantId::parse)
        .transpose()
        .context("--tenant")?;
    let environment = environment
        .map(ferry_domain::EnvironmentId::parse)
        .transpose()
        .context("--environment")?;
    if environment.is_some() && tenant.is_none() {
        bail!("--environment names an environment of a tenant: give --tenant too");
    }
    let by = ferry_domain::Actor::parse("system:ferry-reconcile").context("actor")?;
    if window
        .as_deref()
        .is_some_and(|w| w.trim().is_empty() || w.len() > 64)
    {
        bail!("--window must be 1 to 64 characters");
    }
    let db = open_database(config).await?;
    let scope = reconcile::Scope {
        tenant,
        environment,
    };
    let done = match &window {
        Some(window) => {
            reconcile::leading(&db, || reconcile::reconcile(&db, &scope, window, &by)).await
        }
        None => reconcile::reconcile(&db, &scope, &reconcile::manual_window(), &by)
            .await
            .map(Some),
    };
    db.close().await;
    match done? {
        Some(done) => out(&serde_json::to_string_pretty(&done)?)?,
        None => out(&format!(
            "another instance is reconciling window {}: its runs are this window's",
            window.unwrap_or_default()
        ))?,
    }
    Ok(())
}

/// `ferry projections status|rebuild`.
async fn projections(config: &Config, command: ProjectionsCommand) -> anyhow::Result<()> {
    let db = open_database(config).await?;
    match command {
        ProjectionsCommand::Status => {
            let status = ferry_store::stream::subscription_status(&db).await?;
            out(&format!(
                "{:<24} {:>14} {:>16} {:>10}",
                "SUBSCRIPTION", "POSITION", "TRANSACTION", "LAG"
            ))?;
            for s in status {
                // Beyond the events counted, the lag is the positions' distance.
                let lag = if s.lag_estimated {
                    format!("~{}", s.lag)
                } else {
                    s.lag.to_string()
                };
                out(&format!(
                    "{:<24} {:>14} {:>16} {:>10}",
                    s.name, s.position.global_position, s.position.transaction_id, lag
                ))?;
            }
            if let Some(holder) =
                ferry_store::stream::stream_holder(&db, config.stream_hold_warn).await?
            {
                out(&format!(
                    "\nheld back: {}",
                    ferry_api::router::holder_problem(&holder)
                ))?;
            }
        }
        ProjectionsCommand::Rebuild { name } => {
            // The replay decodes every event: it must know every context's aggregates.
            let contexts = Contexts::builtin();
            contexts.register_aggregates();
            let reports = ferry_projections::rebuild::rebuild_named(
                &db,
                &contexts.projections(),
                name.as_deref(),
            )
            .await?;
            for r in reports {
                out(&format!(
                    "rebuilt {}: {} events replayed, now at position {}",
                    r.projection, r.events, r.position.global_position
                ))?;
            }
        }
    }
    db.close().await;
    Ok(())
}

/// `ferry token`: a token signed with the configured (or embedded) HS256 key.
fn token(
    config: &Config,
    tenant: &str,
    sub: &str,
    scopes: &str,
    roles: &str,
    ttl: u64,
) -> anyhow::Result<()> {
    if config.jwt_jwks_url.is_some() {
        bail!("FERRY_JWT_JWKS_URL is set: tokens come from your identity provider, not from ferry token");
    }
    let (key, signer) = match &config.jwt_hs256_key {
        Some(k) => (
            k.as_bytes().to_vec(),
            "the key of FERRY_JWT_HS256_KEY".to_string(),
        ),
        None => (
            ferry_api::auth::load_or_create_key(&config.data_dir)?,
            ferry_app::server::embedded_key(config),
        ),
    };
    ferry_domain::TenantId::parse(tenant).context("--tenant")?;
    ferry_domain::Actor::parse(sub).context("--sub")?;
    let scopes: Vec<&str> = scopes.split_whitespace().collect();
    let roles: Vec<&str> = roles.split_whitespace().collect();
    for role in &roles {
        if ferry_api::auth::Role::parse(role).is_none() {
            let known: Vec<&str> = ferry_api::auth::Role::ALL.map(|r| r.as_str()).to_vec();
            bail!("--roles: {role:?} is not one of {}", known.join(", "));
        }
    }
    let known = Contexts::builtin().scopes();
    for scope in &scopes {
        if !known.contains(scope) {
            bail!("--scopes: {scope:?} is not one of {}", known.join(", "));
        }
    }
    if scopes.contains(&ferry_api::auth::SCOPE_EVENTS_PUBLISH) && !roles.is_empty() {
        bail!("--scopes factory.events.publish is for service identities: leave --roles empty");
    }
    let token =
        ferry_api::auth::issue_hs256(&key, tenant, sub, &scopes, &roles, Duration::from_secs(ttl))?;
    // On stderr: scripts take the token from stdout, a person sees which key signed it (a
    // server with another data dir refuses it, naming its own key).
    writeln!(std::io::stderr(), "signed with {signer}")?;
    out(&token)
}
