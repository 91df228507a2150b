//! Checks shared by the fuzz targets.

use kubelet_ca_agent::bundle::Rejection;

/// A rejection is logged and shown as is, so its message must stay short and must not
/// carry the input: a bounded length, one line, no control characters.
pub fn check_rejection(rejection: &Rejection) {
    let message = rejection.to_string();
    assert!(
        message.len() <= 300,
        "rejection message is {} bytes: {message:?}",
        message.len()
    );
    assert!(
        !message.chars().any(char::is_control),
        "rejection message has a control character: {message:?}"
    );
}
