package replica

import (
	"context"
	"fmt"
	"log/slog"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/k8spool"
)

// kubeClients is the client a pool watch reads with.
type kubeClients struct {
	dynamic dynamic.Interface
}

// newPoolWatcher watches --inference-pool through the Kubernetes API:
// --kubeconfig when given, else the pod's in-cluster service account.
func newPoolWatcher(cfg Config, log *slog.Logger) (*k8spool.Watcher, error) {
	if cfg.kube != nil {
		return k8spool.New(k8spool.Config{Ref: cfg.InferencePool, Dynamic: cfg.kube.dynamic, Log: log,
			RenewEvery: poolRenewEvery, RetryEvery: poolRetryEvery}), nil
	}
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("inference pool %s: kubernetes client configuration: %w", cfg.InferencePool, err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("inference pool %s: dynamic client: %w", cfg.InferencePool, err)
	}
	return k8spool.New(k8spool.Config{Ref: cfg.InferencePool, Dynamic: dyn, Log: log,
		RenewEvery: poolRenewEvery, RetryEvery: poolRetryEvery}), nil
}

// poolRegistry registers the pool's workers through the path the
// registration API takes (RegisterWorker: validated, placed, leased, for
// the first model), so they are workers like any other: routed, their KV
// events from the bridge checked against the registration.
type poolRegistry struct{ r *replica }

func (p poolRegistry) Register(ctx context.Context, w k8spool.Worker) error {
	return p.r.RegisterWorker(ctx, api.WorkerSpec{ID: w.ID, URL: w.URL, Model: p.r.cfg.Models[0],
		TotalBlocks: w.TotalBlocks, MaxBatchedTokens: w.MaxBatchedTokens})
}

func (p poolRegistry) Deregister(ctx context.Context, id string) error {
	if _, ok := p.r.worker(id); !ok {
		return nil // expired or removed by an operator: nothing to do
	}
	return p.r.DeregisterWorker(ctx, id)
}

// watchPool runs the pool's informers on every replica (a new leader
// starts with their cache warm); only the control group's leader writes
// (syncPool from lead), so replicas watching one pool never undo each
// other's writes.
func (r *replica) watchPool(ctx context.Context) {
	if err := r.pool.Start(ctx); err != nil && ctx.Err() == nil {
		r.log.Error("inference pool watch", "err", err)
	}
}

// syncPool is the leader's duty: the pool's pods as workers, until
// leadership ends.
func (r *replica) syncPool(ctx context.Context) {
	r.log.Info("leading: following the inference pool", "inference_pool", r.cfg.InferencePool.String())
	r.pool.Sync(ctx, poolRegistry{r})
}
