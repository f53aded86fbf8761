// Package deploy holds no library code: it is the home of the deployment
// files (local cluster script, HAProxy, Docker, Compose, Kubernetes,
// Prometheus, Grafana; see README.md) and of the tests that check them
// (deploy_test.go, runsh_test.go).
package deploy
