//! Who a client is: the identity a client certificate or a TokenReview names. Its own
//! module, beneath the ones that find it ([`super::tls`], [`super::review`]) and the one
//! that decides on it ([`super::auth`]), so that none of them import each other through it.

use std::collections::BTreeMap;

use rustls::pki_types::CertificateDer;
use x509_parser::prelude::{FromDer, X509Certificate};

/// An authenticated client: a user name, its groups, and what a TokenReview adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
    pub uid: Option<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl Identity {
    /// The identity a client certificate names, as the kubelet and the API server read it:
    /// the subject's CN is the user, its O values the groups. A subject with several CNs
    /// names its last one, as Go's `pkix.Name` reads it (each CN overwrites the one before).
    pub fn of_certificate(der: &CertificateDer<'_>) -> Result<Identity, String> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|_| "the client certificate does not parse".to_string())?;
        let subject = cert.subject();
        let user = subject
            .iter_common_name()
            .last()
            .and_then(|cn| cn.as_str().ok())
            .filter(|cn| !cn.is_empty())
            .ok_or("the client certificate has no subject CN to name its user")?
            .to_string();
        let groups = subject
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_string))
            .collect();
        Ok(Identity {
            user,
            groups,
            uid: None,
            extra: BTreeMap::new(),
        })
    }
}
