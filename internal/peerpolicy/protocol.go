// Package peerpolicy runs a routing policy that lives in another process —
// another project's scheduler built in its own Go module, with a dependency
// tree kvrouter's go.mod must not carry — and asks it, one request at a time,
// which pod to route to.
//
// The protocol is JSON lines over the peer's stdin and stdout, one line in,
// one line out:
//
//	→ {"version":1,"seed":7,"block_size":16,"pods":[{"name":"w0","gpu_blocks":2048},…]}
//	← {"ready":true,"version":1,"peer":"kvbench-gaie (gateway-api-inference-extension v1.3.0)"}
//	→ {"id":"r1","model":"m","prompt":"…","pods":[{"name":"w0","waiting":0,"running":3,"kv_usage":0.41},…]}
//	← {"pod":"w0"}                      or  {"error":"…"}
//
// The peer answers each request before it reads the next, keeps whatever
// state its policy keeps (a prefix index) between requests, and exits 0 when
// its stdin closes. Its stderr is its log; the client keeps the tail for its
// errors. Client is the kvrouter side (Start, Pick, Close); Serve is the
// peer side, so a peer's main is one call.
//
// The package imports only the standard library: the peer module imports it
// across the module boundary (an internal import is allowed because the
// peer's import path, github.com/kvrouter/kvrouter/peers/…, lies under this
// module's root).
package peerpolicy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// ProtocolVersion is sent in the init line and answered in the ready line;
// a peer that speaks another version refuses to start. Bump it on any
// change a peer built from an older tree would misread.
const ProtocolVersion = 1

// Init configures the peer process once.
type Init struct {
	Seed      uint64    `json:"seed"`       // the policy's only source of randomness (tie-breaks)
	BlockSize int       `json:"block_size"` // tokens per KV block
	Pods      []PodInfo `json:"pods"`
}

// PodInfo is what the peer knows of a pod for the whole run.
type PodInfo struct {
	Name      string `json:"name"`
	GPUBlocks int    `json:"gpu_blocks"` // KV blocks the pod's GPU holds
}

// Pod is one endpoint's metrics as the peer's metrics scraper last saw them.
type Pod struct {
	Name         string  `json:"name"`
	WaitingQueue int     `json:"waiting"`
	Running      int     `json:"running"`
	KVCacheUsage float64 `json:"kv_usage"` // 0..1
}

// Request is one routing decision to make: the candidate pods, in any
// order, with their metrics.
type Request struct {
	ID     string `json:"id"`
	Model  string `json:"model"`
	Prompt string `json:"prompt"`
	Pods   []Pod  `json:"pods"`
}

// Policy is what a peer runs: built once from Init, asked once per request.
// Pick returns the chosen pod's name, which must be one of req.Pods.
type Policy interface {
	Pick(req Request) (string, error)
}

var (
	// ErrPeerMissing: the peer binary is not where the client was told.
	ErrPeerMissing = errors.New("peer binary not found")
	// ErrPeerExited: the peer process ended (or closed its stdout) while
	// the client expected an answer.
	ErrPeerExited = errors.New("peer exited")
	// ErrProtocol: the peer answered something that is not a protocol
	// line, or not the answer that was due.
	ErrProtocol = errors.New("peer protocol error")
)

// PeerError is the peer's own refusal of one request (an {"error":…}
// answer). The client stays usable after it.
type PeerError struct{ Msg string }

func (e *PeerError) Error() string { return "peer: " + e.Msg }

// initLine is the first line the client sends.
type initLine struct {
	Version int `json:"version"`
	Init
}

// answer is every line the peer writes: ready, a pod, or an error.
type answer struct {
	Ready   bool   `json:"ready,omitempty"`
	Version int    `json:"version,omitempty"`
	Peer    string `json:"peer,omitempty"`
	Pod     string `json:"pod,omitempty"`
	Error   string `json:"error,omitempty"`
}

// Line limits. A response is a pod name; anything near a megabyte is a peer
// writing something else. A request carries a prompt and every pod's
// metrics, so the peer accepts much longer lines.
const (
	maxAnswerLine  = 1 << 20
	maxRequestLine = 256 << 20
)

// decodeResponse reads one answer to a request: the chosen pod's name, a
// *PeerError for an {"error":…} answer, or an error wrapping ErrProtocol for
// anything else (not JSON, both or neither of pod and error, a ready line).
func decodeResponse(line []byte) (string, error) {
	var a answer
	if err := json.Unmarshal(line, &a); err != nil {
		return "", fmt.Errorf("%w: answer is not a JSON object (%v): %s", ErrProtocol, err, quoteLine(line))
	}
	switch {
	case a.Error != "" && a.Pod != "":
		return "", fmt.Errorf("%w: answer has both a pod and an error: %s", ErrProtocol, quoteLine(line))
	case a.Error != "":
		return "", &PeerError{Msg: a.Error}
	case a.Pod == "":
		return "", fmt.Errorf("%w: answer has neither a pod nor an error: %s", ErrProtocol, quoteLine(line))
	case a.Ready:
		return "", fmt.Errorf("%w: a ready line where an answer was due: %s", ErrProtocol, quoteLine(line))
	}
	return a.Pod, nil
}

// decodeReady reads the peer's answer to the init line.
func decodeReady(line []byte) (peer string, err error) {
	var a answer
	if err := json.Unmarshal(line, &a); err != nil {
		return "", fmt.Errorf("%w: ready line is not a JSON object (%v): %s", ErrProtocol, err, quoteLine(line))
	}
	switch {
	case a.Error != "":
		return "", &PeerError{Msg: a.Error}
	case !a.Ready:
		return "", fmt.Errorf("%w: expected a ready line, got %s", ErrProtocol, quoteLine(line))
	case a.Version != ProtocolVersion:
		return "", fmt.Errorf("%w: peer speaks protocol version %d, this client %d (rebuild it with make build)", ErrProtocol, a.Version, ProtocolVersion)
	}
	return a.Peer, nil
}

// quoteLine quotes at most 200 bytes of a line for an error message.
func quoteLine(line []byte) string {
	const max = 200
	if len(line) > max {
		return fmt.Sprintf("%q… (%d bytes)", line[:max], len(line))
	}
	return fmt.Sprintf("%q", line)
}

// errLineTooLong is readLine's answer to a line over its limit.
var errLineTooLong = errors.New("line too long")

// readLine returns the next line without its newline. io.EOF means the
// stream ended cleanly between lines; io.ErrUnexpectedEOF that it ended
// inside one. The returned slice is valid until the next read.
func readLine(r *bufio.Reader, limit int) ([]byte, error) {
	var long []byte
	for {
		frag, err := r.ReadSlice('\n')
		if err == nil {
			if long == nil {
				return frag[:len(frag)-1], nil
			}
			long = append(long, frag[:len(frag)-1]...)
			if len(long) > limit {
				return nil, fmt.Errorf("%w (over %d bytes)", errLineTooLong, limit)
			}
			return long, nil
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			if err == io.EOF && len(frag)+len(long) > 0 {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
		long = append(long, frag...)
		if len(long) > limit {
			return nil, fmt.Errorf("%w (over %d bytes)", errLineTooLong, limit)
		}
	}
}

// Serve runs the peer side of the protocol: it reads the init line from r,
// builds the policy with newPolicy, answers ready (naming itself peer), then
// answers each request line with the policy's pick until r ends, when it
// returns nil. A refused init is answered with an error line and returned;
// a request line it cannot decode is answered with an error line, and
// serving goes on.
func Serve(r io.Reader, w io.Writer, peer string, newPolicy func(Init) (Policy, error)) error {
	in := bufio.NewReaderSize(r, 64<<10)
	out := bufio.NewWriter(w)
	send := func(a answer) error {
		b, err := json.Marshal(a)
		if err != nil {
			return err
		}
		b = append(b, '\n')
		if _, err := out.Write(b); err != nil {
			return fmt.Errorf("write answer: %w", err)
		}
		return out.Flush()
	}
	refuse := func(err error) error {
		_ = send(answer{Error: err.Error()})
		return err
	}

	line, err := readLine(in, maxRequestLine)
	if err == io.EOF {
		return nil // closed before configuring us: nothing to do
	}
	if err != nil {
		return refuse(fmt.Errorf("read init line: %w", err))
	}
	var init initLine
	if err := json.Unmarshal(line, &init); err != nil {
		return refuse(fmt.Errorf("decode init line: %w", err))
	}
	if init.Version != ProtocolVersion {
		return refuse(fmt.Errorf("client speaks protocol version %d, this peer %d (rebuild the peer with make build)", init.Version, ProtocolVersion))
	}
	policy, err := newPolicy(init.Init)
	if err != nil {
		return refuse(fmt.Errorf("init: %w", err))
	}
	if err := send(answer{Ready: true, Version: ProtocolVersion, Peer: peer}); err != nil {
		return err
	}

	for {
		line, err := readLine(in, maxRequestLine)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return refuse(fmt.Errorf("read request: %w", err))
		}
		var req Request
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields() // a field we do not know is a client newer than us
		if err := dec.Decode(&req); err != nil {
			if err := send(answer{Error: fmt.Sprintf("decode request: %v", err)}); err != nil {
				return err
			}
			continue
		}
		var a answer
		switch pod, err := policy.Pick(req); {
		case err != nil:
			a.Error = fmt.Sprintf("request %s: %v", req.ID, err)
		case pod == "":
			a.Error = fmt.Sprintf("request %s: the policy chose no pod", req.ID)
		default:
			a.Pod = pod
		}
		if err := send(a); err != nil {
			return err
		}
	}
}
