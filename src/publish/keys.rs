//! The keys the publisher keeps beside the kubelet bundle, so that a node still watches one
//! small object for every CA file it keeps (SPEC 4b, 4c): the cloud-provider CA in
//! [`CLOUD_CA_KEY`], the CA data of the nodes' kubeconfigs in [`KUBECONFIG_CA_KEY`], and each
//! registry CA in `registry.<host..port>`. Pure, like the bundle
//! and registry engines it calls: from the sources' last good content, what the ConfigMap
//! holds now, and `now`, the value of every key, which keys are held as they are and why,
//! and what to tell.
//!
//! The rules:
//! - The cloud CA, and the kubeconfigs' CA, is its sources' certificates, validated and
//!   merged by the bundle's engine and rendered as PEM. The cloud CA is the empty string when
//!   its sources hold none (`cloudProviderCAData` is empty on most platforms), so that a
//!   node's `--manage` file fed by the key has nothing to keep rather than a source that is
//!   down; the kubeconfigs' CA is never empty (it is held instead).
//! - Each registry is the registry engine's file ([`registry::build`]): certificates only,
//!   never a key, a non-CA kept; the first source naming a registry wins.
//! - A key whose new value cannot be used keeps the value the ConfigMap holds (it is
//!   "held"): the cloud CA when a source has never been read or the merge fails, a registry
//!   whose entry is refused, and every registry key while a source has not been read, or
//!   could not be read whole. A held value is sent again as it is, since an apply that left
//!   it out would remove it; one that is not valid itself (edited by hand into a key) is not
//!   sent, and so goes.
//! - An IPv6 registry (`[fd00::1]:5000`) cannot be a ConfigMap key (no brackets, no `:`): it
//!   is skipped, and said. A node reads it from the ControllerConfig if it needs it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::bundle::{self, Certificate, Policy, SourceCertificates};
use crate::registry::{self, Entries, EntryError, RegistryName};
use crate::source::is_configmap_key;

/// The key of the cloud-provider CA.
pub const CLOUD_CA_KEY: &str = "cloud-ca.pem";
/// The key of the CA data of the nodes' kubeconfigs (`--kubeconfig-ca-source`).
pub const KUBECONFIG_CA_KEY: &str = "kubeconfig-ca.crt";

/// A key that holds a bundle of sources of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleKey {
    pub key: &'static str,
    /// What it holds, for messages.
    pub what: &'static str,
    /// Its sources may hold nothing, and the key is then the empty string.
    pub empty_allowed: bool,
}

/// The cloud-provider CA (`--cloud-ca-source`).
pub const CLOUD_CA: BundleKey = BundleKey {
    key: CLOUD_CA_KEY,
    what: "the cloud CA",
    empty_allowed: true,
};

/// The CA data of the nodes' kubeconfigs (`--kubeconfig-ca-source`).
pub const KUBECONFIG_CA: BundleKey = BundleKey {
    key: KUBECONFIG_CA_KEY,
    what: "the kubeconfigs' CA",
    empty_allowed: false,
};
/// The start of every registry's key: `registry.<host..port>`.
pub const REGISTRY_KEY_PREFIX: &str = "registry.";
/// The `reason` of a registry skipped because its name cannot be a key.
pub const SKIPPED: &str = "not_a_configmap_key";

/// The key of a registry: `registry.` and its name with `:` written `..`, as ConfigMap keys
/// (and the `additionalTrustedCA` ConfigMaps registries come from) write it; `None` when that
/// cannot be a ConfigMap key (an IPv6 registry, whose brackets a key cannot hold, or a name
/// too long once prefixed).
pub fn registry_key(name: &RegistryName) -> Option<String> {
    let key = format!("{REGISTRY_KEY_PREFIX}{}", name.dir().replace(':', ".."));
    is_configmap_key(&key).then_some(key)
}

/// What the loop has of one kind of source.
#[derive(Debug, Clone)]
pub enum Read<T> {
    /// Not asked for (no such flag).
    Off,
    /// A source has not given content yet: its keys keep what the ConfigMap holds.
    Unread,
    /// Every source's last good content, in priority order.
    Read(T),
}

/// What the ConfigMap holds now, as far as the other keys go.
#[derive(Debug, Clone, Copy)]
pub struct Current<'a> {
    /// Each key's value (of `data` or `binaryData`), the bundle's key aside.
    pub values: &'a BTreeMap<String, Arc<[u8]>>,
    /// The keys this publisher's field manager owns: those an apply that leaves them out
    /// removes.
    pub owned: &'a BTreeSet<String>,
}

/// Something to log and count once while it lasts: a refused registry entry, a skipped
/// registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Told {
    /// The source spec: the `source` label of `kubelet_ca_source_errors_total`.
    pub source: String,
    pub reason: &'static str,
    pub text: String,
}

/// The other keys, as the sources and the ConfigMap make them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Others {
    /// The value of each key the apply sends, held ones included.
    pub values: BTreeMap<String, String>,
    /// The certificates of each key of `values` (for health, metrics and the timer).
    pub certificates: BTreeMap<String, Vec<Certificate>>,
    /// The keys held as the ConfigMap has them (or, when their value there is not valid,
    /// left out), and why.
    pub held: BTreeMap<String, String>,
    /// Why a bundle key (the cloud CA, the kubeconfigs' CA) could not be built from its
    /// sources, by key: (reason, problem).
    pub problems: BTreeMap<&'static str, (&'static str, String)>,
    /// Refused registry entries and skipped registries: warnings, counted.
    pub refused: Vec<Told>,
    /// Content warnings and shadowed entries: said once, not counted.
    pub warnings: Vec<String>,
}

/// The other keys' values. `now` is unix seconds.
pub fn others(
    bundles: &[(BundleKey, Read<&[SourceCertificates]>)],
    registries: Read<Vec<Entries>>,
    policy: Policy,
    now: i64,
    current: Current<'_>,
) -> Others {
    let mut others = Others::default();
    for (kind, read) in bundles {
        match read {
            Read::Off => {}
            Read::Unread => {
                if current.owned.contains(kind.key) {
                    others.hold(
                        kind.key,
                        format!("a source of {} has not been read yet", kind.what),
                        current,
                        now,
                    );
                }
            }
            Read::Read(sources) => others.bundle_key(*kind, sources, policy, now, current),
        }
    }
    match registries {
        Read::Off => {}
        Read::Unread => {
            for key in registry_keys(current.owned) {
                others.hold(
                    key,
                    "a registry source has not been read yet".into(),
                    current,
                    now,
                );
            }
        }
        Read::Read(sources) => others.registries(sources, now, current),
    }
    others
}

/// The registry keys among `keys`.
fn registry_keys(keys: &BTreeSet<String>) -> impl Iterator<Item = &str> {
    keys.iter()
        .map(String::as_str)
        .filter(|k| k.starts_with(REGISTRY_KEY_PREFIX))
}

impl Others {
    fn bundle_key(
        &mut self,
        kind: BundleKey,
        sources: &[SourceCertificates],
        policy: Policy,
        now: i64,
        current: Current<'_>,
    ) {
        let key = kind.key;
        if kind.empty_allowed
            && sources
                .iter()
                .all(|s| s.certificates.is_empty() && s.not_ca.is_empty())
        {
            // No cloud CA on this platform: the key says so, empty.
            self.values.insert(key.to_string(), String::new());
            self.certificates.insert(key.to_string(), Vec::new());
            return;
        }
        match bundle::build(sources, &[], policy, now) {
            Ok(built) => {
                let rendered = built.bundle.render();
                self.values.insert(
                    key.to_string(),
                    String::from_utf8_lossy(&rendered).into_owned(),
                );
                self.certificates
                    .insert(key.to_string(), built.bundle.certificates().to_vec());
            }
            Err(e) => {
                let problem = format!("{}: {e}", kind.what);
                self.hold(
                    key,
                    format!("{problem}; the key keeps what it holds"),
                    current,
                    now,
                );
                self.problems.insert(key, (e.reason(), problem));
            }
        }
    }

    fn registries(&mut self, sources: Vec<Entries>, now: i64, current: Current<'_>) {
        let merged = registry::merge(sources);
        let places: BTreeMap<RegistryName, registry::Place> = merged
            .registries
            .iter()
            .map(|(name, entry)| (name.clone(), entry.place.clone()))
            .collect();
        let built = registry::build(merged, now);
        for (name, file) in built.files {
            let Some(key) = registry_key(&name) else {
                let source = places.get(&name).map(|p| p.source.clone());
                self.skip(&name, source.unwrap_or_default());
                continue;
            };
            self.values.insert(
                key.clone(),
                String::from_utf8_lossy(&file.bytes).into_owned(),
            );
            self.certificates.insert(key, file.certificates);
        }
        for refused in &built.refused {
            self.refused.push(Told {
                source: refused.place.source.clone(),
                reason: refused.error.reason(),
                text: format!("registry entry refused: {refused}"),
            });
        }
        for name in &built.desired.held {
            let Some(key) = registry_key(name) else {
                let source = places.get(name).map(|p| p.source.clone());
                self.skip(name, source.unwrap_or_default());
                continue;
            };
            let why = built
                .refused
                .iter()
                .find(|r| refused_registry(&r.error).as_ref() == Some(name))
                .map_or_else(|| "its entry was refused".to_string(), ToString::to_string);
            self.hold(
                &key,
                format!("{why}; the key keeps what it holds"),
                current,
                now,
            );
        }
        if built.desired.hold_removals {
            let gone: Vec<&str> = registry_keys(current.owned)
                .filter(|k| !self.values.contains_key(*k) && !self.held.contains_key(*k))
                .collect();
            for key in gone {
                self.hold(
                    key,
                    "its registry left the sources, but a source could not be read whole: no registry key is removed until it can".into(),
                    current,
                    now,
                );
            }
        }
        for warning in &built.warnings {
            self.warnings.push(warning.to_string());
        }
        for shadowed in &built.shadowed {
            self.warnings.push(shadowed.to_string());
        }
    }

    /// A registry whose name cannot be a key.
    fn skip(&mut self, name: &RegistryName, source: String) {
        self.refused.push(Told {
            source,
            reason: SKIPPED,
            text: format!(
                "registry \"{}\" skipped: {REGISTRY_KEY_PREFIX}{} cannot be a ConfigMap key (letters, digits, '-', '_' and '.', at most 253): nodes cannot be given its CA through the ConfigMap",
                crate::text::escape(name.dir()),
                crate::text::escape(&name.dir().replace(':', ".."))
            ),
        });
    }

    /// Holds `key` as the ConfigMap has it, when its value there is valid for the key.
    fn hold(&mut self, key: &str, why: String, current: Current<'_>, now: i64) {
        let valid = current.values.get(key).and_then(|bytes| {
            let text = std::str::from_utf8(bytes).ok()?;
            let certificates = if key == CLOUD_CA_KEY && text.trim().is_empty() {
                Vec::new()
            } else if key == CLOUD_CA_KEY || key == KUBECONFIG_CA_KEY {
                bundle::parse_source(bytes).ok()?.certificates
            } else {
                registry::registry_file(bytes, now).ok()?.certificates
            };
            Some((text.to_string(), certificates))
        });
        let why = match (valid, current.values.contains_key(key)) {
            (Some((value, certificates)), _) => {
                self.values.insert(key.to_string(), value);
                self.certificates.insert(key.to_string(), certificates);
                why
            }
            (None, true) => format!(
                "{why}; but what it holds is not valid for it, so the next apply removes it"
            ),
            (None, false) => why,
        };
        self.held.insert(key.to_string(), why);
    }
}

/// The registry a refusal holds, when it names one.
fn refused_registry(error: &EntryError) -> Option<RegistryName> {
    match error {
        EntryError::NoData { registry }
        | EntryError::BadBase64 { registry }
        | EntryError::Content { registry, .. } => RegistryName::parse(registry).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use serde_json::json;

    const CC: &str = "controllerconfig:machine-config-controller";

    fn b64(bytes: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn ca(cn: &str) -> Vec<u8> {
        let now = test_certs::now();
        test_certs::ca(Some(cn), None, now - 3600, now + 86400)
            .pem()
            .to_vec()
    }

    fn policy() -> Policy {
        Policy {
            retain_removed: 0,
            drop_expired: false,
        }
    }

    fn list(entries: &[(&str, &[u8])]) -> Entries {
        let value = entries
            .iter()
            .map(|(file, data)| json!({"file": file, "data": b64(data)}))
            .collect();
        registry::from_list(
            CC,
            "imageRegistryBundleData",
            &serde_json::Value::Array(value),
        )
    }

    fn nothing() -> (BTreeMap<String, Arc<[u8]>>, BTreeSet<String>) {
        (BTreeMap::new(), BTreeSet::new())
    }

    fn text(bytes: &[u8]) -> String {
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[test]
    fn registry_keys_write_the_port_as_dots_and_skip_what_a_key_cannot_hold() {
        let key = |raw: &str| registry_key(&RegistryName::parse(raw).unwrap());
        assert_eq!(
            key("image-registry.openshift-image-registry.svc..5000").as_deref(),
            Some("registry.image-registry.openshift-image-registry.svc..5000")
        );
        assert_eq!(key("quay.io:443").as_deref(), Some("registry.quay.io..443"));
        assert_eq!(key("quay.io").as_deref(), Some("registry.quay.io"));
        assert_eq!(key("[fd00::1]:5000"), None);
        let label = "a".repeat(61);
        let long = format!("{}.com", [label.as_str(); 4].join("."));
        assert!(long.len() <= 253 && long.len() + 9 > 253, "{}", long.len());
        assert_eq!(key(&long), None);
    }

    #[test]
    fn every_key_is_derived_and_an_empty_cloud_ca_is_the_empty_string() {
        let (quay, internal, cloud) = (ca("quay"), ca("internal"), ca("cloud"));
        let (values, owned) = nothing();
        let current = Current {
            values: &values,
            owned: &owned,
        };
        let cloud_source = bundle::parse_source(&cloud).unwrap();
        let sources = vec![
            list(&[("image-registry.svc..5000", &internal)]),
            list(&[("quay.io", &quay), ("image-registry.svc:5000", &quay)]),
        ];
        let built = others(
            &[(CLOUD_CA, Read::Read(std::slice::from_ref(&cloud_source)))],
            Read::Read(sources),
            policy(),
            test_certs::now(),
            current,
        );
        let keys: Vec<&str> = built.values.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "cloud-ca.pem",
                "registry.image-registry.svc..5000",
                "registry.quay.io"
            ]
        );
        assert_eq!(built.values["cloud-ca.pem"], text(&cloud));
        // The first source naming a registry wins, however it spells it.
        assert_eq!(
            built.values["registry.image-registry.svc..5000"],
            text(&internal)
        );
        assert_eq!(built.warnings.len(), 1, "{:?}", built.warnings);
        assert!(built.held.is_empty() && built.refused.is_empty());

        let empty = SourceCertificates::default();
        let built = others(
            &[(CLOUD_CA, Read::Read(std::slice::from_ref(&empty)))],
            Read::Off,
            policy(),
            test_certs::now(),
            current,
        );
        assert_eq!(built.values["cloud-ca.pem"], "");
        assert_eq!(built.values.len(), 1);
    }

    #[test]
    fn a_refused_entry_holds_its_key_as_the_configmap_has_it_and_an_ipv6_registry_is_skipped() {
        let (quay, local, key) = (
            ca("quay"),
            ca("local"),
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".to_vec(),
        );
        let values: BTreeMap<String, Arc<[u8]>> = [
            ("registry.quay.io".to_string(), Arc::from(&quay[..])),
            ("registry.gone.example".to_string(), Arc::from(&quay[..])),
            ("registry.edited.example".to_string(), Arc::from(&key[..])),
        ]
        .into();
        let owned: BTreeSet<String> = values.keys().cloned().collect();
        let current = Current {
            values: &values,
            owned: &owned,
        };
        let new_quay = [quay.clone(), local.clone()].concat();
        let sources = vec![list(&[
            ("quay.io", &[new_quay.as_slice(), &key].concat()),
            ("local..5000", &local),
            ("[fd00::1]:5000", &local),
            ("edited.example", b"not a certificate"),
        ])];
        let built = others(
            &[],
            Read::Read(sources),
            policy(),
            test_certs::now(),
            current,
        );
        // quay.io keeps what it held; local is new; gone.example left the sources (not sent,
        // so the apply removes it); the hand-edited key is not sent again.
        let keys: Vec<&str> = built.values.keys().map(String::as_str).collect();
        assert_eq!(keys, ["registry.local..5000", "registry.quay.io"]);
        assert_eq!(built.values["registry.quay.io"], text(&quay));
        let why = &built.held["registry.quay.io"];
        assert!(
            why.contains("the content for \"quay.io\"") && why.contains("keeps what it holds"),
            "{why}"
        );
        assert!(
            built.held["registry.edited.example"].contains("the next apply removes it"),
            "{:?}",
            built.held
        );
        let reasons: Vec<&str> = built.refused.iter().map(|t| t.reason).collect();
        assert!(reasons.contains(&"private_key"), "{reasons:?}");
        assert!(reasons.contains(&"not_a_configmap_key"), "{reasons:?}");
        let skipped = built
            .refused
            .iter()
            .find(|t| t.reason == "not_a_configmap_key")
            .unwrap();
        assert!(skipped.text.contains("[fd00::1]:5000"), "{}", skipped.text);
        assert_eq!(skipped.source, CC);
        assert!(!built.values.values().any(|v| v.contains("PRIVATE KEY")));
    }

    #[test]
    fn unread_sources_hold_every_key_this_publisher_owns() {
        let (quay, cloud) = (ca("quay"), ca("cloud"));
        let values: BTreeMap<String, Arc<[u8]>> = [
            ("registry.quay.io".to_string(), Arc::from(&quay[..])),
            ("registry.theirs".to_string(), Arc::from(&quay[..])),
            ("cloud-ca.pem".to_string(), Arc::from(&cloud[..])),
        ]
        .into();
        let owned: BTreeSet<String> = ["registry.quay.io", "cloud-ca.pem"]
            .map(str::to_string)
            .into();
        let current = Current {
            values: &values,
            owned: &owned,
        };
        let built = others(
            &[(CLOUD_CA, Read::Unread)],
            Read::Unread,
            policy(),
            test_certs::now(),
            current,
        );
        let keys: Vec<&str> = built.values.keys().map(String::as_str).collect();
        assert_eq!(keys, ["cloud-ca.pem", "registry.quay.io"]);
        assert_eq!(built.held.len(), 2);
        // A source not whole holds removals, not the rest.
        let broken = registry::from_list(CC, "imageRegistryBundleData", &json!({"not": "a list"}));
        let built = others(
            &[],
            Read::Read(vec![broken]),
            policy(),
            test_certs::now(),
            current,
        );
        assert_eq!(
            built.values.keys().collect::<Vec<_>>(),
            ["registry.quay.io"]
        );
        assert!(built.held["registry.quay.io"].contains("could not be read whole"));
    }

    #[test]
    fn a_cloud_ca_that_cannot_be_built_keeps_the_key() {
        let now = test_certs::now();
        let expired = test_certs::ca(Some("old"), None, now - 7200, now - 3600)
            .pem()
            .to_vec();
        let cloud = ca("cloud");
        let values: BTreeMap<String, Arc<[u8]>> =
            [("cloud-ca.pem".to_string(), Arc::from(&cloud[..]))].into();
        let owned = values.keys().cloned().collect();
        let current = Current {
            values: &values,
            owned: &owned,
        };
        let source = bundle::parse_source(&expired).unwrap();
        let built = others(
            &[(CLOUD_CA, Read::Read(std::slice::from_ref(&source)))],
            Read::Off,
            Policy {
                retain_removed: 0,
                drop_expired: true,
            },
            now,
            current,
        );
        assert_eq!(built.values["cloud-ca.pem"], text(&cloud));
        assert!(built.problems.contains_key("cloud-ca.pem"));
        assert!(built.held.contains_key("cloud-ca.pem"));
    }
}
