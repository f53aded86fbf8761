// Package gaie runs the Gateway API Inference Extension's endpoint-picker
// scheduler (sigs.k8s.io/gateway-api-inference-extension v1.3.0,
// pkg/epp/scheduling) as a peerpolicy.Policy, so `kvbench sim` can route
// with it. It builds the scheduler the way the EPP does from its Helm
// chart's default configuration, and does the two things the EPP's director
// does around each Schedule call: it hands the scheduler fresh pod metric
// snapshots, and it calls the prefix-cache plugin's PreRequest with the
// result. What it changes, it changes only to be deterministic (DESIGN.md).
package gaie

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"github.com/go-logr/logr"
	k8stypes "k8s.io/apimachinery/pkg/types"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/kvrouter/kvrouter/internal/peerpolicy"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/backend"
	backendmetrics "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/backend/metrics"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/datalayer"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/plugins"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling/framework"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling/framework/plugins/multi/prefix"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling/framework/plugins/profile"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling/framework/plugins/scorer"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/scheduling/types"
)

// Name is how the peer names itself in its ready line.
const Name = "kvbench-gaie (sigs.k8s.io/gateway-api-inference-extension v1.3.0, default profile)"

// The default scheduling profile of GAIE v1.3.0, as its Helm chart writes
// it (config/charts/inferencepool/templates/epp-config.yaml, the
// default-plugins.yaml ConfigMap): these three scorers with these weights,
// in this order, and the max-score picker the config loader adds to a
// profile that names none (pkg/epp/config/loader/defaults.go), returning one
// endpoint.
const (
	QueueWeight   = 2 // queue-scorer
	KVCacheWeight = 2 // kv-cache-utilization-scorer
	PrefixWeight  = 3 // prefix-cache-scorer
)

// profileName is the chart's one profile.
const profileName = "default"

// namespace is the pods' namespace: the prefix index keys pods by
// namespaced name, and one pool lives in one namespace.
const namespace = "kvbench"

// Policy is GAIE's scheduler with its default profile over a fixed set of
// pods. It is not safe for concurrent use: the peer asks it one request at
// a time, and its determinism depends on that order.
type Policy struct {
	ctx        context.Context
	scheduler  *scheduling.Scheduler
	prefix     *prefix.Plugin
	prefixDone *sync.WaitGroup // the prefix plugin's own: PreRequest's index update
	blockSize  int
	gpuBlocks  map[string]int
}

// New builds the scheduler for init's pods. init.Seed seeds the picker's
// tie-break; init.BlockSize is each pod's CacheBlockSize (tokens per KV
// block) and PodInfo.GPUBlocks its CacheNumGPUBlocks, the two metrics the
// prefix plugin's auto-tune reads.
func New(init peerpolicy.Init) (*Policy, error) {
	if init.BlockSize <= 0 {
		return nil, fmt.Errorf("block size %d: must be positive (tokens per KV block)", init.BlockSize)
	}
	if len(init.Pods) == 0 {
		return nil, errors.New("no pods")
	}
	gpuBlocks := make(map[string]int, len(init.Pods))
	for _, p := range init.Pods {
		if p.Name == "" {
			return nil, errors.New("a pod without a name")
		}
		if _, dup := gpuBlocks[p.Name]; dup {
			return nil, fmt.Errorf("pod %q named twice", p.Name)
		}
		if p.GPUBlocks < 0 {
			return nil, fmt.Errorf("pod %q: %d GPU blocks", p.Name, p.GPUBlocks)
		}
		gpuBlocks[p.Name] = p.GPUBlocks
	}

	// GAIE's plugins log through the logger in their context; an explicit
	// one keeps them off controller-runtime's global logger.
	ctx := ctrllog.IntoContext(context.Background(), logr.Discard())
	pfx := prefix.New(ctx, prefix.DefaultConfig)
	done, err := prefixWaitGroup(pfx)
	if err != nil {
		return nil, err
	}
	prof := framework.NewSchedulerProfile()
	if err := prof.AddPlugins(
		framework.NewWeightedScorer(scorer.NewQueueScorer(), QueueWeight),
		framework.NewWeightedScorer(scorer.NewKVCacheUtilizationScorer(), KVCacheWeight),
		framework.NewWeightedScorer(pfx, PrefixWeight),
		newSeededMaxScorePicker(init.Seed),
	); err != nil {
		return nil, fmt.Errorf("build the default profile: %w", err)
	}
	cfg := scheduling.NewSchedulerConfig(profile.NewSingleProfileHandler(),
		map[string]*framework.SchedulerProfile{profileName: prof})
	return &Policy{
		ctx:        ctx,
		scheduler:  scheduling.NewSchedulerWithConfig(cfg),
		prefix:     pfx,
		prefixDone: done,
		blockSize:  init.BlockSize,
		gpuBlocks:  gpuBlocks,
	}, nil
}

// Pick schedules one request over req.Pods, as the EPP's director does:
// Schedule over a snapshot of the pods' metrics, then the prefix plugin's
// PreRequest with the result, whose index update it waits for, so the next
// Pick sees it.
func (p *Policy) Pick(req peerpolicy.Request) (string, error) {
	if len(req.Pods) == 0 {
		return "", errors.New("no candidate pods")
	}
	pods := make([]types.Pod, len(req.Pods))
	seen := make(map[string]bool, len(req.Pods))
	for i, m := range req.Pods {
		gpu, ok := p.gpuBlocks[m.Name]
		if !ok {
			return "", fmt.Errorf("pod %q was not in init", m.Name)
		}
		if seen[m.Name] {
			return "", fmt.Errorf("pod %q offered twice", m.Name)
		}
		seen[m.Name] = true
		// KVCacheUsagePercent is a fraction in GAIE (the scorer scores
		// 1 - usage; vLLM's kv_cache_usage_perc is 0..1): a value over 1
		// is a percentage sent by mistake.
		if m.KVCacheUsage < 0 || m.KVCacheUsage > 1 || math.IsNaN(m.KVCacheUsage) {
			return "", fmt.Errorf("pod %q: KV cache usage %v is not in 0..1", m.Name, m.KVCacheUsage)
		}
		pods[i] = &types.PodMetrics{
			Pod: &backend.Pod{
				NamespacedName: k8stypes.NamespacedName{Namespace: namespace, Name: m.Name},
				PodName:        m.Name,
				Address:        m.Name,
			},
			MetricsState: &backendmetrics.MetricsState{
				ActiveModels:        map[string]int{},
				WaitingModels:       map[string]int{},
				WaitingQueueSize:    m.WaitingQueue,
				RunningRequestsSize: m.Running,
				KVCacheUsagePercent: m.KVCacheUsage,
				CacheBlockSize:      p.blockSize,
				CacheNumGPUBlocks:   gpu,
			},
			AttributeMap: datalayer.NewAttributes(),
		}
	}
	llm := &types.LLMRequest{
		RequestId:   req.ID,
		TargetModel: req.Model,
		// A completions request: the prefix plugin hashes its prompt text.
		Body:    &types.LLMRequestBody{Completions: &types.CompletionsRequest{Prompt: req.Prompt}},
		Headers: map[string]string{},
	}
	res, err := p.scheduler.Schedule(p.ctx, llm, pods)
	if err != nil {
		return "", fmt.Errorf("schedule: %w", err)
	}
	primary := res.ProfileResults[res.PrimaryProfileName]
	if primary == nil || len(primary.TargetPods) == 0 {
		return "", errors.New("schedule: no target pod")
	}
	p.prefix.PreRequest(p.ctx, llm, res)
	// PreRequest adds the request's blocks to the index in a goroutine;
	// the next Schedule must see them, whatever the goroutine scheduler
	// does.
	p.prefixDone.Wait()
	return primary.TargetPods[0].GetPod().NamespacedName.Name, nil
}

// prefixWaitGroup finds the prefix plugin's WaitGroup, which counts its
// PreRequest's index updates (v1.3.0 keeps it unexported, "to allow waiting
// in tests"). Waiting on it is the only exact way to know the update is
// done; a GAIE version without it fails here, at start, not with a racy
// index.
func prefixWaitGroup(p *prefix.Plugin) (*sync.WaitGroup, error) {
	f := reflect.ValueOf(p).Elem().FieldByName("wg")
	if !f.IsValid() || f.Type() != reflect.TypeFor[sync.WaitGroup]() {
		return nil, errors.New("prefix.Plugin has no wg sync.WaitGroup field: the GAIE version changed, and with it how to wait for PreRequest's index update")
	}
	return (*sync.WaitGroup)(unsafe.Pointer(f.UnsafeAddr())), nil
}

// seededMaxScorePicker is GAIE's max-score picker (picker.MaxScorePicker,
// one endpoint) with a seeded tie-break. Like it, it shuffles the scored
// pods and then stable-sorts them by score, so equal scores are broken
// uniformly at random; unlike it, its shuffle draws from one generator
// seeded once (GAIE seeds one from the clock on each Pick), after putting
// the pods in name order (the profile hands them over in map order).
type seededMaxScorePicker struct {
	typedName plugins.TypedName
	rng       *rand.Rand
}

var _ framework.Picker = (*seededMaxScorePicker)(nil)

func newSeededMaxScorePicker(seed uint64) *seededMaxScorePicker {
	return &seededMaxScorePicker{
		typedName: plugins.TypedName{Type: "seeded-max-score-picker", Name: "max-score-picker"},
		rng:       rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)),
	}
}

func (s *seededMaxScorePicker) TypedName() plugins.TypedName { return s.typedName }

func (s *seededMaxScorePicker) Pick(_ context.Context, _ *types.CycleState, scored []*types.ScoredPod) *types.ProfileRunResult {
	if len(scored) == 0 {
		return &types.ProfileRunResult{}
	}
	slices.SortFunc(scored, func(a, b *types.ScoredPod) int {
		return strings.Compare(a.GetPod().NamespacedName.Name, b.GetPod().NamespacedName.Name)
	})
	s.rng.Shuffle(len(scored), func(i, j int) { scored[i], scored[j] = scored[j], scored[i] })
	slices.SortStableFunc(scored, func(a, b *types.ScoredPod) int { // highest score first
		switch {
		case a.Score > b.Score:
			return -1
		case a.Score < b.Score:
			return 1
		}
		return 0
	})
	return &types.ProfileRunResult{TargetPods: []types.Pod{scored[0]}}
}
