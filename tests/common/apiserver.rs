//! Placeholder: a local kube-apiserver for tests is being written here.
