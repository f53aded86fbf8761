package zmqbridge

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/eventbus/registrar"
)

// registrarConfig is how the bridge registers a worker with the replicas:
// its HTTP client, the admin token, the lease. A deregistration the
// replicas refuse (not registered) is an error: Remove reports it.
func (b *Bridge) registrarConfig(spec registrar.Spec, log *slog.Logger) registrar.Config {
	return registrar.Config{URLs: b.cfg.Register, Token: b.cfg.AdminToken, Spec: spec,
		Interval: b.cfg.RegisterInterval, Client: b.cfg.HTTPClient, Logger: log}
}

// EngineInfo is what an engine's HTTP surface says about itself.
type EngineInfo struct {
	Engine      string // "vllm", "sglang" or ""
	TotalBlocks int    // KV cache capacity in blocks of the router's size; 0 = unknown
	BlockSize   int    // the engine's block (page) size; 0 = not reported
	Prefix      bool   // prefix caching reported enabled (vLLM); true when not reported
}

// ProbeModel returns the first model id of GET <url>/v1/models.
func ProbeModel(ctx context.Context, client *http.Client, baseURL string) (string, error) {
	body, err := get(ctx, client, strings.TrimRight(baseURL, "/")+"/v1/models", 1<<20)
	if err != nil {
		return "", err
	}
	var doc struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		return "", fmt.Errorf("/v1/models: %w", err)
	}
	if len(doc.Data) == 0 || doc.Data[0].ID == "" {
		return "", errors.New("/v1/models lists no model")
	}
	return doc.Data[0].ID, nil
}

// ProbeMetrics reads the KV cache capacity from the engine's Prometheus
// metrics: vLLM's vllm:cache_config_info{num_gpu_blocks, block_size,
// enable_prefix_caching}, or SGLang's sglang:num_pages,
// sglang:max_total_num_tokens and sglang:page_size. blockSize converts
// token capacities into blocks.
//
// The per-step token budget (max_num_batched_tokens) is not read: no
// engine exports it. vLLM's only config metric, cache_config_info, carries
// CacheConfig's fields, and the budget is SchedulerConfig's; SGLang's
// collector exports max_total_num_tokens (the KV pool) but not
// chunked_prefill_size (older releases had sglang:max_prefill_tokens, the
// cap on one prefill batch's tokens, 16,384 by default, which is not the
// step budget). It comes from the worker's spec or not at all.
func ProbeMetrics(ctx context.Context, client *http.Client, metricsURL string, blockSize int) (EngineInfo, error) {
	body, err := get(ctx, client, metricsURL, 16<<20)
	if err != nil {
		return EngineInfo{}, err
	}
	return ParseMetrics(body, blockSize)
}

// ParseMetrics is ProbeMetrics on a scraped body.
func ParseMetrics(body []byte, blockSize int) (EngineInfo, error) {
	info := EngineInfo{Prefix: true}
	var sgTokens, sgPages float64
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, labels, value, ok := parseSample(line)
		if !ok {
			continue
		}
		switch name {
		case "vllm:cache_config_info":
			info.Engine = "vllm"
			if n, err := strconv.Atoi(labels["num_gpu_blocks"]); err == nil && n > 0 && (info.TotalBlocks == 0 || n < info.TotalBlocks) {
				info.TotalBlocks = n // per engine (rank); the smallest if several
			}
			if n, err := strconv.Atoi(labels["block_size"]); err == nil && n > 0 {
				info.BlockSize = n
			}
			if v, ok := labels["enable_prefix_caching"]; ok {
				info.Prefix = strings.EqualFold(v, "true")
			}
		case "sglang:max_total_num_tokens":
			info.Engine = "sglang"
			sgTokens = value
		case "sglang:num_pages":
			info.Engine = "sglang"
			sgPages = value
		case "sglang:page_size":
			info.Engine = "sglang"
			info.BlockSize = countOf(value)
		}
	}
	if info.Engine == "sglang" {
		switch {
		case sgPages > 0 && (info.BlockSize == 0 || info.BlockSize == blockSize):
			info.TotalBlocks = countOf(sgPages)
		case sgTokens > 0 && blockSize > 0:
			info.TotalBlocks = countOf(sgTokens) / blockSize
		}
	}
	if info.Engine == "" {
		return info, errors.New("no vllm:cache_config_info or sglang:max_total_num_tokens metric")
	}
	return info, nil
}

// countOf reads a gauge as a count: 0 (unknown) unless it is a finite
// value in [0, 2^40] — a float outside int's range has no defined int
// conversion, and +Inf or 1e300 must not become a capacity.
func countOf(v float64) int {
	if math.IsNaN(v) || v < 0 || v > 1<<40 {
		return 0
	}
	return int(v)
}

// parseSample parses one Prometheus text line: name{labels} value.
func parseSample(line string) (name string, labels map[string]string, value float64, ok bool) {
	i := strings.IndexAny(line, "{ ")
	if i <= 0 {
		return "", nil, 0, false
	}
	name, rest := line[:i], line[i:]
	labels = map[string]string{}
	if rest[0] == '{' {
		rest = rest[1:]
		for {
			rest = strings.TrimLeft(rest, " ,")
			if rest == "" {
				return "", nil, 0, false
			}
			if rest[0] == '}' {
				rest = rest[1:]
				break
			}
			eq := strings.IndexByte(rest, '=')
			if eq <= 0 || len(rest) < eq+2 || rest[eq+1] != '"' {
				return "", nil, 0, false
			}
			key := strings.TrimSpace(rest[:eq])
			rest = rest[eq+2:]
			var val strings.Builder
			j := 0
			for ; j < len(rest) && rest[j] != '"'; j++ {
				if rest[j] == '\\' && j+1 < len(rest) {
					j++
					switch rest[j] {
					case 'n':
						val.WriteByte('\n')
					default:
						val.WriteByte(rest[j])
					}
					continue
				}
				val.WriteByte(rest[j])
			}
			if j >= len(rest) {
				return "", nil, 0, false
			}
			labels[key] = val.String()
			rest = rest[j+1:]
		}
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", nil, 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil || math.IsNaN(v) {
		return name, labels, 0, err == nil
	}
	return name, labels, v, true
}

func get(ctx context.Context, client *http.Client, u string, limit int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: HTTP %d", u, resp.StatusCode)
	}
	return io.ReadAll(io.LimitReader(resp.Body, limit))
}
