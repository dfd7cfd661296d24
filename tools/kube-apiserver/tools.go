//go:build tools

// Package tools pins the commands this module builds: `go build
// k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl`.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
