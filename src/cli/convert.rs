//! The conversion from what clap parsed to the checked configuration ([`crate::config`]).
//! Flags that parse one by one but do not hold together are refused here, once, as usage
//! errors (exit 2), before anything starts.

use std::path::PathBuf;

use super::{
    CommonArgs, LogFormat, OutputFormat, PublishArgs, RolloutArgs, RolloutStatusArgs,
    RolloutWaitArgs, RunArgs, ServerArgs, SyncArgs, TlsVersion, host_name,
};
use crate::config;
use crate::config::KubeconfigHook;
use crate::error::UsageError;
use crate::source::SourceSpec;

impl LogFormat {
    /// The logging module's own format.
    pub fn config(self) -> crate::logging::LogFormat {
        match self {
            LogFormat::Text => crate::logging::LogFormat::Text,
            LogFormat::Json => crate::logging::LogFormat::Json,
        }
    }
}

impl RunArgs {
    /// The endpoint's flags are checked first, then the managed files'.
    pub fn config(&self) -> Result<config::Run, UsageError> {
        let args = self;
        let server = args.server.config()?;
        let report = (!args.no_node_report).then(|| config::NodeReport {
            kubeconfig: args.report_kubeconfig.clone(),
            node_name: args.server.node_name.clone().filter(|n| !n.is_empty()),
        });
        Ok(config::Run {
            common: args.common.config()?,
            server,
            kubelet_config: args.kubelet_config.clone(),
            report,
        })
    }
}

impl SyncArgs {
    /// The checked configuration these flags make.
    pub fn config(&self) -> Result<config::Sync, UsageError> {
        let args = self;
        Ok(config::Sync {
            common: args.common.config()?,
            dry_run: args.dry_run,
            force: args.force,
        })
    }
}

impl CommonArgs {
    /// Refuses two managed files at one path, a registry directory over a managed file or
    /// another set, a source read both ways, and an `--exec-on-change` program that cannot run.
    pub fn config(&self) -> Result<config::Common, UsageError> {
        let args = self;
        let common = config::Common {
            sources: args.sources.clone(),
            bundle: args.bundle.clone(),
            kubeconfig: args.kubeconfig.clone(),
            state_dir: args.state_dir.clone(),
            file_mode: args.file_mode,
            drop_expired: args.drop_expired,
            retain_removed: args.retain_removed,
            exec_on_change: args.exec_on_change.clone(),
            exec_on_change_timeout: args.exec_on_change_timeout,
            manage: args.manage.clone(),
            manage_registries: args.manage_registries.clone(),
            manage_kubeconfig: args.manage_kubeconfig.clone(),
            kubeconfig_hook: kubeconfig_hook(args)?,
        };
        check_managed_paths(&common).map_err(UsageError)?;
        if let Some(command) = &common.exec_on_change {
            crate::exec::check(&command.0).map_err(UsageError)?;
        }
        if let Some(KubeconfigHook::Command(command)) = &common.kubeconfig_hook {
            crate::exec::check(command)
                .map_err(|e| UsageError(format!("--kubeconfig-hook: {e}")))?;
        }
        Ok(common)
    }
}

/// What is done after a managed kubeconfig gained a CA: `--kubeconfig-hook`, or the
/// kubelet's restart asked of the host. The old `--kubeconfig-restart-unit kubelet.service`
/// (which had the agent itself hold systemd's bus) is read as the request, with a warning;
/// another unit is refused.
fn kubeconfig_hook(args: &CommonArgs) -> Result<Option<KubeconfigHook>, UsageError> {
    if let Some(command) = &args.kubeconfig_hook {
        return Ok(Some(KubeconfigHook::Command(command.0.clone())));
    }
    if let Some(dir) = &args.kubeconfig_restart_request {
        return Ok(Some(KubeconfigHook::Request(dir.clone())));
    }
    match args.kubeconfig_restart_unit.as_deref() {
        None => Ok(None),
        Some("kubelet.service") => {
            tracing::warn!(
                "--kubeconfig-restart-unit is replaced by --kubeconfig-restart-request: the agent no longer holds systemd's bus; asking the host through {} (install kubelet-ca-agent-kubelet-restart.path: docs/operations.md)",
                crate::kubelet_restart::DEFAULT_DIR
            );
            Ok(Some(KubeconfigHook::Request(
                crate::kubelet_restart::DEFAULT_DIR.into(),
            )))
        }
        Some(unit) => Err(UsageError(format!(
            "--kubeconfig-restart-unit {unit}: the agent no longer restarts units itself (it never holds systemd's bus); the kubelet's restart is asked of the host with --kubeconfig-restart-request, and another command can run as --kubeconfig-hook"
        ))),
    }
}

impl ServerArgs {
    /// Refuses flags that do not make one coherent endpoint, and fills in the node's name
    /// when it was not given.
    pub fn config(&self) -> Result<config::Server, UsageError> {
        let args = self;
        let server = config::Server {
            listen: args.listen,
            tls_cert_file: args.tls_cert_file.clone(),
            tls_private_key_file: args.tls_private_key_file.clone(),
            tls_min_version: match args.tls_min_version {
                TlsVersion::V1_2 => config::TlsVersion::V1_2,
                TlsVersion::V1_3 => config::TlsVersion::V1_3,
            },
            client_ca_file: args.client_ca_file.clone(),
            authorized_users: args.authorized_users.clone(),
            authorized_groups: args.authorized_groups.clone(),
            authentication_token_webhook: args.authentication_token_webhook,
            authentication_token_audiences: args.authentication_token_audiences.clone(),
            authentication_token_webhook_cache_ttl: args.authentication_token_webhook_cache_ttl,
            authorization_webhook: args.authorization_webhook,
            authorization_webhook_cache_authorized_ttl: args
                .authorization_webhook_cache_authorized_ttl,
            authorization_webhook_cache_unauthorized_ttl: args
                .authorization_webhook_cache_unauthorized_ttl,
            insecure_metrics: args.insecure_metrics,
            node_name: node_name(args.node_name.as_deref()),
        };
        check_listen(&server)?;
        Ok(server)
    }
}

impl PublishArgs {
    /// Refuses the bundle's key where another key goes and a source read both ways; the
    /// endpoint's flags are checked only when it will serve (not with `--once`).
    pub fn config(&self) -> Result<config::Publish, UsageError> {
        let args = self;
        check_publish(args).map_err(UsageError)?;
        let server = if args.once {
            None
        } else {
            Some(args.server.config()?)
        };
        Ok(config::Publish {
            to: args.to.clone(),
            sources: args.sources.clone(),
            cloud_ca_sources: args.cloud_ca_sources.clone(),
            kubeconfig_ca_sources: args.kubeconfig_ca_sources.clone(),
            registry_sources: args.registry_sources.clone(),
            kubeconfig: args.kubeconfig.clone(),
            drop_expired: args.drop_expired,
            node_selector: args.node_selector.clone().filter(|s| !s.trim().is_empty()),
            server,
        })
    }
}

impl RolloutArgs {
    /// The checked configuration, for `status` (`json`) or `wait`.
    fn config(&self, json: bool, wait: Option<config::RolloutWait>) -> config::Rollout {
        let empty = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
        config::Rollout {
            sources: self.sources.clone(),
            target: empty(&self.target),
            selector: empty(&self.selector),
            kubeconfig: self.kubeconfig.clone(),
            pick: crate::credentials::Pick {
                context: empty(&self.context),
                cluster: empty(&self.cluster),
                user: empty(&self.user),
            },
            drop_expired: self.drop_expired,
            json,
            wait,
        }
    }
}

impl RolloutStatusArgs {
    pub fn config(&self) -> config::Rollout {
        self.rollout.config(self.output == OutputFormat::Json, None)
    }
}

impl RolloutWaitArgs {
    pub fn config(&self) -> config::Rollout {
        let wait = config::RolloutWait {
            condition: self.condition.clone(),
            timeout: self.timeout.filter(|t| !t.is_zero()),
        };
        self.rollout.config(false, Some(wait))
    }
}

/// `--node-name`, or, when it was not given (or given empty, as an EnvironmentFile line
/// `KUBELET_CA_AGENT_NODE_NAME=` does), this host's name, which is the node's name on a
/// node and, with host networking, in its pod. A systemd EnvironmentFile cannot say
/// `$(hostname)`.
fn node_name(given: Option<&str>) -> Option<String> {
    match given {
        Some(name) if !name.is_empty() => Some(name.to_string()),
        _ => host_name(),
    }
}

/// Two managed files at one path (the bundle, or another `--manage` file) would each
/// put back the other's content: refused at start.
fn check_managed_paths(common: &config::Common) -> Result<(), String> {
    let absolute = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut seen = vec![(absolute(&common.bundle), "--bundle".to_string())];
    for manage in &common.manage {
        let path = absolute(&manage.path);
        if let Some((_, first)) = seen.iter().find(|(p, _)| *p == path) {
            return Err(format!(
                "--manage {}: that file is already managed ({first}); each file can have one set of sources",
                manage.path.display()
            ));
        }
        seen.push((path, format!("--manage {}", manage.path.display())));
    }
    for kubeconfig in &common.manage_kubeconfig {
        let path = absolute(&kubeconfig.path);
        if let Some((_, first)) = seen.iter().find(|(p, _)| *p == path) {
            return Err(format!(
                "--manage-kubeconfig {}: that file is already managed ({first}); each file can have one set of sources",
                kubeconfig.path.display()
            ));
        }
        seen.push((
            path,
            format!("--manage-kubeconfig {}", kubeconfig.path.display()),
        ));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    for set in &common.manage_registries {
        let dir = absolute(&set.dir);
        let flag = format!("--manage-registries {}", set.dir.display());
        if let Some(other) = roots
            .iter()
            .find(|r| dir.starts_with(r) || r.starts_with(&dir))
        {
            return Err(format!(
                "{flag}: it overlaps the registry directory {} of another --manage-registries; each directory can have one set of sources",
                other.display()
            ));
        }
        if let Some((_, file)) = seen.iter().find(|(p, _)| p.starts_with(&dir)) {
            return Err(format!(
                "{flag}: {file} is a file under it; a managed file cannot live in a registry directory"
            ));
        }
        roots.push(dir);
    }
    let file_specs: Vec<&SourceSpec> = common
        .sources
        .iter()
        .chain(common.manage.iter().flat_map(|m| m.sources.iter()))
        .chain(
            common
                .manage_kubeconfig
                .iter()
                .flat_map(|m| m.sources.iter()),
        )
        .collect();
    for set in &common.manage_registries {
        if let Some(spec) = set.sources.iter().find(|s| file_specs.contains(s)) {
            return Err(format!(
                "--manage-registries {}: {spec} is also a source of a file; a source is read either as one bundle or as a registry list, not both",
                set.dir.display()
            ));
        }
    }
    Ok(())
}

/// The SERVER flags make one coherent endpoint: `--insecure-metrics` only on a loopback
/// address (SPEC 3) and never beside a flag that asks for TLS or authentication (it would
/// silently win, or lose); off loopback, some way to authenticate a scraper (an endpoint that
/// answers 401 to everyone forever is a mistake, not a choice). Each refusal says which
/// flags to use instead; docs/security.md lists every combination that is accepted.
fn check_listen(server: &config::Server) -> Result<(), UsageError> {
    let listen = server.listen;
    if server.insecure_metrics && !listen.ip().is_loopback() {
        return Err(UsageError(format!(
            "--listen {listen}: --insecure-metrics is only allowed on a loopback address (use 127.0.0.1:PORT, or drop --insecure-metrics and add --client-ca-file)"
        )));
    }
    let secured: Vec<&str> = [
        (server.tls_cert_file.is_some(), "--tls-cert-file"),
        (
            server.tls_private_key_file.is_some(),
            "--tls-private-key-file",
        ),
        (server.client_ca_file.is_some(), "--client-ca-file"),
        (
            server.authentication_token_webhook,
            "--authentication-token-webhook",
        ),
        (server.authorization_webhook, "--authorization-webhook"),
        (
            server.authorized_users.iter().any(|u| !u.is_empty()),
            "--authorized-users",
        ),
        (
            server.authorized_groups.iter().any(|g| !g.is_empty()),
            "--authorized-groups",
        ),
    ]
    .into_iter()
    .filter_map(|(given, flag)| given.then_some(flag))
    .collect();
    if server.insecure_metrics && !secured.is_empty() {
        let flags = secured.join(", ");
        return Err(UsageError(format!(
            "--insecure-metrics serves /metrics to anyone, over plain HTTP, but {flags} ask(s) for TLS or authentication: drop --insecure-metrics to require credentials, or drop {flags} to serve plain HTTP on loopback"
        )));
    }
    let authenticates = server.client_ca_file.is_some() || server.authentication_token_webhook;
    if !listen.ip().is_loopback() && !server.insecure_metrics && !authenticates {
        return Err(UsageError(format!(
            "--listen {listen} is not a loopback address, and nothing could authenticate a scraper there: add --client-ca-file (with --authorized-users or --authorized-groups) or --authentication-token-webhook, or listen on 127.0.0.1 with --insecure-metrics"
        )));
    }
    Ok(())
}

/// Flags that parse one by one but not together: the bundle's key where another key
/// goes, or a source read both as a bundle and as a registry list.
fn check_publish(args: &PublishArgs) -> Result<(), String> {
    let key = &args.to.key;
    if !args.cloud_ca_sources.is_empty() && key == crate::publish::keys::CLOUD_CA_KEY {
        return Err(format!(
            "--to {}/{}/{key}: that key holds the cloud CA (--cloud-ca-source); put the bundle in another key",
            args.to.namespace, args.to.name
        ));
    }
    if !args.kubeconfig_ca_sources.is_empty() && key == crate::publish::keys::KUBECONFIG_CA_KEY {
        return Err(format!(
            "--to {}/{}/{key}: that key holds the kubeconfigs' CA (--kubeconfig-ca-source); put the bundle in another key",
            args.to.namespace, args.to.name
        ));
    }
    if !args.registry_sources.is_empty()
        && key.starts_with(crate::publish::keys::REGISTRY_KEY_PREFIX)
    {
        return Err(format!(
            "--to {}/{}/{key}: the keys {}* hold the registry CAs (--registry-source); put the bundle in another key",
            args.to.namespace,
            args.to.name,
            crate::publish::keys::REGISTRY_KEY_PREFIX
        ));
    }
    let bundles: Vec<&SourceSpec> = args
        .sources
        .iter()
        .chain(&args.cloud_ca_sources)
        .chain(&args.kubeconfig_ca_sources)
        .collect();
    if let Some(spec) = args.registry_sources.iter().find(|s| bundles.contains(s)) {
        return Err(format!(
            "--registry-source {spec} is also a source of a bundle (--source, --cloud-ca-source or --kubeconfig-ca-source); a source is read either as one bundle or as a registry list, not both"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn parse(args: &[&str]) -> Command {
        Cli::try_parse_from(std::iter::once("kubelet-ca-agent").chain(args.iter().copied()))
            .unwrap()
            .command
    }

    #[test]
    fn publish_once_serves_nothing_so_its_endpoint_flags_are_not_checked() {
        let to = "--to=ns/name";
        let Command::Publish(once) = parse(&["publish", to, "--once", "--listen=0.0.0.0:9745"])
        else {
            unreachable!()
        };
        assert!(once.config().unwrap().server.is_none());
        let Command::Publish(watching) = parse(&["publish", to, "--listen=0.0.0.0:9745"]) else {
            unreachable!()
        };
        let refused = watching.config().unwrap_err();
        assert!(refused.0.contains("is not a loopback address"), "{refused}");
    }

    #[test]
    fn run_checks_the_endpoint_before_the_managed_files() {
        let Command::Run(args) = parse(&[
            "run",
            "--listen=0.0.0.0:9745",
            "--manage=/etc/kubernetes/kubelet-ca.crt=file:/run/ca.pem",
        ]) else {
            unreachable!()
        };
        let refused = args.config().unwrap_err();
        assert!(refused.0.contains("is not a loopback address"), "{refused}");
        let Command::Run(args) = parse(&[
            "run",
            "--manage=/etc/kubernetes/kubelet-ca.crt=file:/run/ca.pem",
        ]) else {
            unreachable!()
        };
        let refused = args.config().unwrap_err();
        assert!(
            refused.0.contains("already managed (--bundle)"),
            "{refused}"
        );
    }

    #[test]
    fn an_empty_node_name_is_this_hosts_name() {
        assert_eq!(node_name(Some("node-1")).as_deref(), Some("node-1"));
        assert_eq!(node_name(Some("")), host_name());
        assert_eq!(node_name(None), host_name());
    }

    #[test]
    fn the_tls_version_and_the_values_are_carried_over() {
        let Command::Run(args) = parse(&[
            "run",
            "--tls-min-version=1.3",
            "--retain-removed=2d",
            "--file-mode=0600",
            "--node-name=node-1",
        ]) else {
            unreachable!()
        };
        let run = args.config().unwrap();
        assert_eq!(run.server.tls_min_version, config::TlsVersion::V1_3);
        assert_eq!(run.server.node_name.as_deref(), Some("node-1"));
        assert_eq!(run.common.retain_removed.as_secs(), 2 * 86400);
        assert_eq!(run.common.file_mode, 0o600);
    }
}
