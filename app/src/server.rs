//! Process wiring: opening the store, building the ports from the configuration, starting
//! the projections, workers, relay and inbound consumers, and serving the HTTP API until a
//! shutdown signal.

use crate::config::{Config, ConfigError, LogFormat, RunnerKind};
use crate::contexts::{Contexts, Process};
use crate::telemetry::{NatsHealth, ProcessTelemetry};
use ferry_api::auth::{load_or_create_key, Verifier};
use ferry_api::state::AppState;
use ferry_projections::{Projector, ReadModels};
use ferry_store::{stream, Database, DatabaseError};
use std::collections::HashMap;
use std::net::SocketAddr;
use tokio::sync::watch;

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store.
    #[error(transparent)]
    Database(#[from] DatabaseError),
    /// The signing key.
    #[error(transparent)]
    Key(#[from] ferry_api::auth::KeyError),
    /// The listen address.
    #[error("cannot listen on FERRY_HTTP_ADDR={addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Creating read-model tables.
    #[error("cannot create read models")]
    Projections(#[source] sqlx::Error),
    /// A policy file that does not compile (names the file and line).
    #[error("FERRY_POLICY_DIR: a policy cannot be loaded")]
    Policy(#[from] ferry_adapters::policy::PolicyLoadError),
    /// The NATS relay could not be set up.
    #[error("NATS_URL: the relay to JetStream cannot start")]
    Relay(#[from] ferry_messaging::RelayError),
    /// The inbound consumers could not be set up.
    #[error("NATS_URL: the inbound consumers cannot start")]
    Inbound(#[from] ferry_messaging::inbound::InboundStartError),
    /// Two contexts register one inbound event or subject with different payload types.
    #[error(transparent)]
    InboundClash(#[from] ferry_messaging::InboundClash),
    /// The artifact store URL.
    #[error("FERRY_ARTIFACTS_URL: the artifact store cannot be used")]
    Artifacts(#[from] ferry_adapters::artifacts::ArtifactConfigError),
    /// A setting that cannot be used (e.g. a tenant root holding Ferry's files).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A metric family the process's registry refused (a name registered twice).
    #[error("the metrics registry refused a family")]
    Metrics(#[from] prometheus::Error),
    /// The internal gRPC interface cannot start.
    #[error(transparent)]
    Grpc(#[from] crate::grpc::GrpcError),
}

/// The adapters the configuration asks for, each confining references to what the run's
/// tenant may reach ([`Config::confinement`]). A policy that does not compile, or a tenant
/// setting that cannot be used, stops here.
pub fn ports(config: &Config) -> Result<crate::contexts::provisioning::work::Ports, StartError> {
    use ferry_adapters::{
        ConfigSources, GitProgramSource, ObjectArtifacts, RegoPolicy, SecretResolvers, VaultConfig,
    };
    use ferry_domain::ports::runner::Runner;
    use std::sync::Arc;
    let data = &config.data_dir;
    let confinement = Arc::new(config.confinement()?);
    let runner: Arc<dyn Runner> = match config.runner {
        RunnerKind::Simulated => Arc::new(ferry_runners::SimulatedRunner::new(data.clone())),
        RunnerKind::Pulumi => Arc::new(ferry_runners::PulumiRunner::new(
            config.pulumi_bin.clone(),
            data.join("runner-homes"),
        )),
        RunnerKind::Http => Arc::new(ferry_runners::HttpRunner::new(
            config
                .runner_url
                .clone()
                .ok_or_else(|| crate::config::ConfigError {
                    setting: "FERRY_RUNNER_URL".to_string(),
                    source_name: "configuration".to_string(),
                    reason: "FERRY_RUNNER=http needs FERRY_RUNNER_URL".to_string(),
                })?,
            config.runner_token.clone(),
        )),
    };
    let vault = config.vault_addr.as_ref().map(|address| VaultConfig {
        address: address.clone(),
        token: ferry_domain::ports::SecretValue::new(
            config.vault_token.clone().unwrap_or_default(),
        ),
    });
    Ok(crate::contexts::provisioning::work::Ports {
        programs: Arc::new(GitProgramSource::new(
            data.join("git-cache"),
            confinement.clone(),
        )),
        runner,
        secrets: Arc::new(SecretResolvers::new(
            ferry_api::auth::load_or_create_key_file(data, "secret-fingerprint.key")?,
            vault,
            confinement.clone(),
        )),
        config: Arc::new(ConfigSources::new(
            data.join("config-last-known-good"),
            confinement,
        )),
        policy: Arc::new(RegoPolicy::load(config.policy_dir.as_deref())?),
        artifacts: Arc::new(ObjectArtifacts::from_url(
            config.artifacts_url.as_deref(),
            &data.join("artifacts"),
        )?),
    })
}

/// Worker settings from the configuration.
pub fn worker_settings(config: &Config) -> crate::contexts::provisioning::work::Settings {
    let mut settings = crate::contexts::provisioning::work::Settings::new(&config.data_dir);
    settings.apply_timeout = config.apply_timeout;
    settings.approval_expiry = config.approval_expiry;
    settings.poll = config.poll_interval;
    settings.lease = config.worker_lease;
    settings.recovery_grace = config.worker_recovery_grace;
    settings.limits = crate::contexts::provisioning::work::limits::Limits {
        program_bytes: config.max_program_bytes,
        plan_resources: config.max_plan_resources,
        receipt_bytes: config.max_receipt_bytes,
    };
    settings.baseline_programs = config.baseline_programs.iter().cloned().collect();
    settings
}

/// Sets up logging from the configuration.
pub fn init_tracing(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log_filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match config.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Pretty => builder.try_init(),
    };
}

/// Opens the configured store (Postgres with `DATABASE_URL`, else SQLite in the data dir)
/// and runs the migrations and the read-model DDL.
pub async fn open_database(config: &Config) -> Result<Database, StartError> {
    let options = store_options(config);
    let db = match &config.database_url {
        Some(url) => Database::connect_postgres_with(url, &options).await?,
        None => Database::open_sqlite_with(&config.data_dir, &options).await?,
    };
    db.migrate().await?;
    ferry_projections::projection::ensure_all_tables(&db, &Contexts::builtin().projections())
        .await
        .map_err(StartError::Projections)?;
    Ok(db)
}

/// How the store's connections behave, from the configuration.
pub fn store_options(config: &Config) -> ferry_store::StoreOptions {
    ferry_store::StoreOptions {
        acquire_timeout: config.store_acquire_timeout,
        sqlite_busy_timeout: config.sqlite_busy_timeout,
        idle_in_transaction_timeout: config.idle_in_transaction_timeout,
        aggregate_cache_events: config.aggregate_cache_events,
    }
}

/// The embedded signing key, in words: the file in the data dir.
pub fn embedded_key(config: &Config) -> String {
    let file = config.data_dir.join(ferry_api::auth::KEY_FILE);
    let file = std::path::absolute(&file).unwrap_or(file);
    format!("the embedded key in {}", file.display())
}

/// The token verifier the configuration asks for.
pub fn verifier(config: &Config) -> Result<Verifier, StartError> {
    let (iss, aud) = (config.jwt_issuer.as_deref(), config.jwt_audience.as_deref());
    Ok(match (&config.jwt_jwks_url, &config.jwt_hs256_key) {
        (Some(url), _) => Verifier::jwks(url, iss, aud),
        (None, Some(key)) => {
            Verifier::hs256(key.as_bytes(), iss, aud).described("the key of FERRY_JWT_HS256_KEY")
        }
        (None, None) => Verifier::hs256(&load_or_create_key(&config.data_dir)?, iss, aud)
            .described(embedded_key(config)),
    })
}

/// A running server.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Where the internal gRPC interface listens (`FERRY_GRPC_ADDR`), if it is served.
    pub grpc_addr: Option<SocketAddr>,
    grpc: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
    shutdown: watch::Sender<bool>,
    /// The configuration it started with, and its reloadable part as running now.
    started_with: Config,
    options: watch::Sender<crate::config::Reloadable>,
    handle: tokio::task::JoinHandle<Result<(), std::io::Error>>,
    db: Database,
    messaging: Option<(ferry_messaging::Relay, ferry_messaging::inbound::Inbound)>,
}

impl Server {
    /// Opens the store, starts the projections and listens.
    pub async fn start(config: &Config) -> Result<Self, StartError> {
        let db = open_database(config).await?;
        Self::start_with(config, db).await
    }

    /// As [`Server::start`], on an already opened and migrated store.
    pub async fn start_with(config: &Config, db: Database) -> Result<Self, StartError> {
        Self::start_with_contexts(config, db, Contexts::builtin()).await
    }

    /// As [`Server::start_with`], running `contexts` (e.g. Ferry's own and a test's).
    pub async fn start_with_contexts(
        config: &Config,
        db: Database,
        contexts: Contexts,
    ) -> Result<Self, StartError> {
        contexts.register_aggregates();
        let publishers = contexts.publishers();
        let verifier = verifier(config)?;
        let confinement = std::sync::Arc::new(config.confinement()?);
        let ports = ports(config)?;
        let artifacts = ports.artifacts.clone();
        // One registry per server, not the library's global one: servers sharing a process
        // (the end-to-end tests) each serve their own counts.
        let registry = prometheus::Registry::new();
        let metrics =
            std::sync::Arc::new(crate::contexts::provisioning::work::metrics::Metrics::new()?);
        metrics.register(&registry)?;
        let stream_hold_warn = config.stream_hold_warn;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let (options, options_rx) = watch::channel(config.reloadable());
        stream::spawn_notifications(&db, shutdown_rx.clone());
        let projector = Projector::start(
            &db,
            &contexts.projections(),
            config.poll_interval,
            shutdown_rx.clone(),
        )
        .await
        .map_err(StartError::Projections)?;
        let reads = ReadModels::new(db.clone(), Some(projector.subscribe()));
        contexts.start(&Process {
            db: &db,
            config,
            ports: &ports,
            metrics: &metrics,
            registry: &registry,
            shutdown: &shutdown_rx,
            options: &options_rx,
        })?;
        let handler = std::sync::Arc::new(contexts.inbound(&crate::inbound::InboundParts {
            db: db.clone(),
            metrics: metrics.clone(),
            confinement: confinement.clone(),
            programs: ports.programs.clone(),
        })?);
        // An entry naming no event any context hears would trust nothing, silently.
        config
            .trusted_sources
            .check_events(&contexts.inbound_kinds()?)
            .map_err(|e| crate::ConfigError {
                setting: "FERRY_TRUSTED_SOURCES".to_string(),
                source_name: "configuration".to_string(),
                reason: e.to_string(),
            })?;
        // Who may post inbound events: the open single-team default, or sources trusted
        // but spoken for by no service over HTTP, is worth an operator's attention.
        for warning in config.trusted_sources.warnings() {
            tracing::warn!(%warning, "inbound trust");
        }
        let (inbound, nats, messaging) =
            start_messaging(config, &db, handler, &publishers, &registry, &shutdown_rx).await?;
        inbound.metrics.register(&registry)?;
        let grpc_metrics = crate::grpc::GrpcMetrics::new(&registry)?;
        let services = ferry_api::state::Services {
            verifier,
            read_your_writes: config.read_your_writes,
            telemetry: std::sync::Arc::new(
                ProcessTelemetry::new(db.clone(), registry, metrics, nats)?
                    .with_inbound_trust(config.trusted_sources.report()),
            ),
            artifacts,
            intake: std::sync::Arc::new(crate::events::Intake::new(inbound)),
            feed: std::sync::Arc::new(crate::events::Feed::new(db.clone(), publishers)),
            stream_hold_warn,
            confinement,
            programs: ports.programs.clone(),
        };
        let state = AppState::new(db.clone(), reads, services);
        let (addr, handle) =
            serve_http(config, state.clone(), &contexts, shutdown_rx.clone()).await?;
        let grpc = match config.grpc_addr {
            Some(addr) => Some(crate::grpc::serve(state, grpc_metrics, addr, shutdown_rx).await?),
            None => None,
        };
        tracing::info!(%addr, backend = ?db.backend(), "ferry is serving");
        let (grpc_addr, grpc) = match grpc {
            Some((addr, handle)) => (Some(addr), Some(handle)),
            None => (None, None),
        };
        Ok(Self {
            addr,
            grpc_addr,
            grpc,
            shutdown,
            started_with: config.clone(),
            options,
            handle,
            db,
            messaging,
        })
    }

    /// Stops serving and the background subscriptions, and waits for in-flight requests.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.handle.await;
        if let Some(grpc) = self.grpc {
            let _ = grpc.await;
        }
        if let Some((relay, inbound)) = self.messaging {
            // Bounded: a relay waiting on an unreachable NATS must not hold the exit.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                relay.join().await;
                inbound.join().await;
            })
            .await;
        }
        self.db.close().await;
    }

    /// Reads the configuration again (the file it started with, then `env`) and takes up its
    /// reloadable settings ([`crate::config::Reloadable`]) at once. Returns whether they
    /// changed. A configuration that does not load is refused and nothing changes; other
    /// settings that changed are named in a warning: they take effect at the next start.
    pub fn reload(&self, env: &HashMap<String, String>) -> Result<bool, ConfigError> {
        let newer = Config::load(self.started_with.config_file.as_deref(), env)?;
        if self.started_with.needs_restart_for(&newer) {
            tracing::warn!(
                "the configuration changed in settings that are not reloadable; they take effect at the next start"
            );
        }
        let reloadable = newer.reloadable();
        let changed = self.options.send_if_modified(|current| {
            let changed = *current != reloadable;
            *current = reloadable.clone();
            changed
        });
        tracing::info!(
            changed,
            promotion_path = ?reloadable.promotion_path.classes(),
            verification_window = ?reloadable.verification_window,
            auto_rollback = reloadable.auto_rollback,
            "configuration reloaded"
        );
        Ok(changed)
    }

    /// Serves until Ctrl-C or SIGTERM; on SIGHUP reloads the configuration (with `env`, the
    /// process's environment).
    pub async fn run_until_signal(self, env: &HashMap<String, String>) {
        let stop = shutdown_signal();
        tokio::pin!(stop);
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            #[cfg(unix)]
            let reload = async {
                match hangup.as_mut() {
                    Some(h) => {
                        h.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let reload = std::future::pending::<()>();
            tokio::select! {
                _ = &mut stop => break,
                _ = reload => {
                    if let Err(error) = self.reload(env) {
                        tracing::error!(%error, "the configuration was not reloaded; the settings in use stay");
                    }
                }
            }
        }
        tracing::info!("shutting down");
        self.stop().await;
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

/// The relay and the inbound consumers when NATS is configured; without it, only the
/// inbound context `POST /factory/events` uses.
async fn start_messaging(
    config: &Config,
    db: &Database,
    handler: std::sync::Arc<crate::inbound::FerryInbound>,
    publishers: &ferry_messaging::Publishers,
    registry: &prometheus::Registry,
    shutdown_rx: &watch::Receiver<bool>,
) -> Result<
    (
        ferry_messaging::inbound::InboundContext,
        Option<NatsHealth>,
        Option<(ferry_messaging::Relay, ferry_messaging::inbound::Inbound)>,
    ),
    StartError,
> {
    let context = ferry_messaging::inbound::InboundContext::new(db.clone(), handler)
        .with_trusted_sources(config.trusted_sources.clone());
    let Some(url) = &config.nats_url else {
        return Ok((context, None, None));
    };
    let relay_config = ferry_messaging::RelayConfig {
        nats_url: url.clone(),
        nats_auth: config.nats_auth.clone(),
        stream_name: config.nats_stream.clone(),
        poll: config.poll_interval,
        subjects: ferry_messaging::subjects::stream_subjects(publishers),
        publishers: publishers.clone(),
        ..ferry_messaging::RelayConfig::default()
    };
    let relay =
        ferry_messaging::Relay::start(db.clone(), relay_config.clone(), shutdown_rx.clone())
            .await?;
    let inbound = ferry_messaging::inbound::Inbound::start_with(
        context,
        ferry_messaging::inbound::InboundConfig {
            nats_auth: config.nats_auth.clone(),
            ..ferry_messaging::inbound::InboundConfig::new(url)
        },
        shutdown_rx.clone(),
    )
    .await?;
    relay.metrics().register(registry, &config.nats_stream)?;
    inbound.statuses().register(registry)?;
    let health = NatsHealth {
        stream: config.nats_stream.clone(),
        checkpoint: relay_config.checkpoint_name(),
        relay: relay.metrics(),
        consumers: inbound.statuses(),
    };
    Ok((inbound.context(), Some(health), Some((relay, inbound))))
}

/// Binds the HTTP port and serves every context's routes until shutdown.
async fn serve_http(
    config: &Config,
    state: AppState,
    contexts: &Contexts,
    mut stop: watch::Receiver<bool>,
) -> Result<
    (
        std::net::SocketAddr,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ),
    StartError,
> {
    let bind_error = |source| StartError::Bind {
        addr: config.http_addr,
        source,
    };
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .map_err(bind_error)?;
    let addr = listener.local_addr().map_err(bind_error)?;
    // The console's CSRF key lives beside the other keys, so every instance of a
    // deployment accepts the forms another served.
    let key = ferry_api::auth::load_or_create_key_file(&config.data_dir, "console-csrf.key")?;
    let pages = crate::console::routes(crate::console::session::ConsoleKey::new(key));
    let app = ferry_api::router(state, contexts.api(), pages);
    let handle = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
    });
    Ok((addr, handle))
}
