//! Who is asking, and may they: identities from client certificates, and the static
//! allow-list (`--authorized-users`, `--authorized-groups`), checked locally with no API
//! call, so that scraping keeps working while the API server is down.

use std::collections::BTreeSet;

use rustls::pki_types::CertificateDer;
use x509_parser::prelude::{FromDer, X509Certificate};

/// An authenticated client: a user name and its groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
}

impl Identity {
    /// The identity a client certificate names, as the kubelet and the API server read it:
    /// the subject's CN is the user, its O values the groups.
    pub fn of_certificate(der: &CertificateDer<'_>) -> Result<Identity, String> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|_| "the client certificate does not parse".to_string())?;
        let subject = cert.subject();
        let user = subject
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .filter(|cn| !cn.is_empty())
            .ok_or("the client certificate has no subject CN to name its user")?
            .to_string();
        let groups = subject
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_string))
            .collect();
        Ok(Identity { user, groups })
    }
}

/// How an authenticated identity is authorized for `/metrics`.
#[derive(Debug, Clone)]
pub enum Authorization {
    /// `--authorized-users` / `--authorized-groups`: allowed when the user or one of its
    /// groups is listed.
    AllowList {
        users: BTreeSet<String>,
        groups: BTreeSet<String>,
    },
    /// No list given: any authenticated identity (a warning is logged at start).
    AnyAuthenticated,
}

impl Authorization {
    pub fn allows(&self, identity: &Identity) -> bool {
        match self {
            Authorization::AllowList { users, groups } => {
                users.contains(&identity.user) || identity.groups.iter().any(|g| groups.contains(g))
            }
            Authorization::AnyAuthenticated => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(user: &str, groups: &[&str]) -> Identity {
        Identity {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn the_allow_list_admits_listed_users_and_members_of_listed_groups() {
        let list = Authorization::AllowList {
            users: ["system:serviceaccount:monitoring:prometheus-k8s".to_string()].into(),
            groups: ["system:monitoring".to_string()].into(),
        };
        assert!(list.allows(&identity(
            "system:serviceaccount:monitoring:prometheus-k8s",
            &[]
        )));
        assert!(list.allows(&identity("scraper", &["other", "system:monitoring"])));
        assert!(!list.allows(&identity("scraper", &["other"])));
        assert!(
            !list.allows(&identity("system:monitoring", &[])),
            "a user is not a group"
        );
        assert!(Authorization::AnyAuthenticated.allows(&identity("anyone", &[])));
    }
}
