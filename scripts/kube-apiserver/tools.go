//go:build tools

// Package tools names the one package this module exists to build (go mod tidy keeps its requirements).
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
