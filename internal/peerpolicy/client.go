package peerpolicy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// Client is one running peer process. Pick and Close are safe to call from
// several goroutines, but the peer answers one request at a time, so they
// take turns.
type Client struct {
	path   string
	ctx    context.Context
	cmd    *exec.Cmd
	stdin  *os.File      // our end of the peer's stdin
	stdout *os.File      // our end of the peer's stdout
	out    *bufio.Reader // reads stdout
	stderr *tail
	exited chan struct{} // closed once cmd.Wait returned; waitErr is set before
	// waitErr is cmd.Wait's result; read it only after exited is closed.
	waitErr error

	mu     sync.Mutex // held for a whole Pick or Close; guards the fields below
	peer   string
	enc    bytes.Buffer
	broken error // sticky: the peer died or spoke garbage; every later Pick returns it
	closed bool
	closeE error
}

// How long the client waits for a peer that closed its stdout (or its
// stdin was closed) to exit before it kills it.
const exitGrace = 10 * time.Second

// Start executes the peer binary at path, sends it init and waits for its
// ready line. Cancelling ctx kills the peer, which also ends a Pick blocked
// on it. A missing binary is an error wrapping ErrPeerMissing (and
// fs.ErrNotExist); a peer that refuses init answers a *PeerError; one that
// exits first, an error wrapping ErrPeerExited.
func Start(ctx context.Context, path string, init Init) (*Client, error) {
	resolved, err := exec.LookPath(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, exec.ErrNotFound) {
			return nil, fmt.Errorf("%w: %s (build it with make build): %w", ErrPeerMissing, path, err)
		}
		return nil, fmt.Errorf("peer binary %s: %w", path, err)
	}
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("peer %s: stdin pipe: %w", path, err)
	}
	stdoutR, stdoutW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		return nil, fmt.Errorf("peer %s: stdout pipe: %w", path, err)
	}
	c := &Client{
		path:   path,
		ctx:    ctx,
		stdin:  stdinW,
		stdout: stdoutR,
		out:    bufio.NewReaderSize(stdoutR, 4096),
		stderr: &tail{max: 8 << 10},
		exited: make(chan struct{}),
	}
	// Pipes we own, not exec's: exec.Cmd.Wait closes the pipes it made as
	// soon as the process exits, which could drop an answer (an error line)
	// the peer wrote just before exiting. With *os.File ends Wait leaves
	// ours alone.
	c.cmd = exec.CommandContext(ctx, resolved)
	c.cmd.Stdin = stdinR
	c.cmd.Stdout = stdoutW
	c.cmd.Stderr = c.stderr
	c.cmd.WaitDelay = exitGrace // bounds Wait if a grandchild holds stderr open
	err = c.cmd.Start()
	stdinR.Close() // the child's ends: the child has its own copies now
	stdoutW.Close()
	if err != nil {
		stdinW.Close()
		stdoutR.Close()
		return nil, fmt.Errorf("start peer %s: %w", path, err)
	}
	go func() {
		c.waitErr = c.cmd.Wait()
		close(c.exited)
	}()

	line, err := json.Marshal(initLine{Version: ProtocolVersion, Init: init})
	if err == nil {
		_, err = c.stdin.Write(append(line, '\n'))
	}
	if err != nil {
		return nil, c.abandon(c.fail("sending init", err))
	}
	answer, err := readLine(c.out, maxAnswerLine)
	if err != nil {
		return nil, c.abandon(c.fail("waiting for ready", err))
	}
	c.peer, err = decodeReady(answer)
	if err != nil {
		var pe *PeerError
		if errors.As(err, &pe) {
			return nil, c.abandon(fmt.Errorf("peer %s refused init: %w", path, err))
		}
		return nil, c.abandon(c.fail("waiting for ready", err))
	}
	return c, nil
}

// Peer is how the peer named itself in its ready line.
func (c *Client) Peer() string { return c.peer }

// Pick asks the peer which of req.Pods should serve req, and returns that
// pod's name. A peer's refusal of this one request is a *PeerError and the
// client stays usable; a peer that died or answered garbage makes this and
// every later Pick fail with an error wrapping ErrPeerExited or ErrProtocol.
func (c *Client) Pick(req Request) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return "", c.broken
	}
	if c.closed {
		return "", fmt.Errorf("peer %s: Pick after Close", c.path)
	}
	if err := c.ctx.Err(); err != nil {
		// Cancelled: the kill runs asynchronously, and a Pick racing it
		// could still be answered by a peer its owner has let go.
		return "", c.fail("sending request "+req.ID, err)
	}
	c.enc.Reset()
	enc := json.NewEncoder(&c.enc)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(req); err != nil { // Encode ends the line
		return "", fmt.Errorf("encode request %s: %w", req.ID, err)
	}
	if _, err := c.stdin.Write(c.enc.Bytes()); err != nil {
		return "", c.fail("sending request "+req.ID, err)
	}
	line, err := readLine(c.out, maxAnswerLine)
	if err != nil {
		return "", c.fail("waiting for the answer to request "+req.ID, err)
	}
	pod, err := decodeResponse(line)
	var pe *PeerError
	if errors.As(err, &pe) {
		return "", fmt.Errorf("pick %s: %w", req.ID, err)
	}
	if err != nil {
		return "", c.fail("answer to request "+req.ID, err)
	}
	for _, p := range req.Pods {
		if p.Name == pod {
			return pod, nil
		}
	}
	// In step with us, but wrong: not sticky.
	return "", fmt.Errorf("%w: request %s: peer chose %q, which was not offered", ErrProtocol, req.ID, pod)
}

// Close ends the peer: it closes the peer's stdin, which a peer answers by
// exiting 0, and waits for it (killing it after 10 s). It returns an error
// if the peer exited otherwise, unless a Pick already reported its end.
// Calling Close again returns the first call's result.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return c.closeE
	}
	c.closed = true
	c.stdin.Close()
	c.waitExit()
	c.stdout.Close()
	if c.broken == nil && c.waitErr != nil {
		c.closeE = fmt.Errorf("%w: %s on close: %v%s", ErrPeerExited, c.path, c.waitErr, c.stderr.suffix())
	}
	return c.closeE
}

// fail turns an I/O or protocol failure into the client's sticky error: it
// waits for a peer that is ending anyway (or kills one that is out of step)
// and names its exit status and the end of its stderr. mu must be held (or
// c not yet shared, in Start).
func (c *Client) fail(what string, err error) error {
	if errors.Is(err, ErrProtocol) || errors.Is(err, errLineTooLong) {
		// Out of step with us: the next line could belong to anything.
		_ = c.cmd.Process.Kill()
		c.waitExit()
		if !errors.Is(err, ErrProtocol) {
			err = fmt.Errorf("%w: %w", ErrProtocol, err)
		}
		c.broken = fmt.Errorf("peer %s: %s: %w (peer stopped)%s", c.path, what, err, c.stderr.suffix())
		return c.broken
	}
	// A write to a closed pipe or a read that met the end: the peer is
	// exiting, or has. Its exit status says why.
	var status string
	if c.waitExit() {
		status = "it closed its stdout but kept running: killed"
	} else if c.waitErr == nil {
		status = "exit status 0"
	} else {
		status = c.waitErr.Error()
	}
	if ctxErr := c.ctx.Err(); ctxErr != nil {
		status += ", " + ctxErr.Error()
	}
	c.broken = fmt.Errorf("%w: %s (%s) while %s%s", ErrPeerExited, c.path, status, what, c.stderr.suffix())
	return c.broken
}

// waitExit waits for the peer to exit, killing it after exitGrace; it
// reports whether it had to.
func (c *Client) waitExit() (killed bool) {
	t := time.NewTimer(exitGrace)
	defer t.Stop()
	select {
	case <-c.exited:
		return false
	case <-t.C:
	}
	_ = c.cmd.Process.Kill()
	<-c.exited
	return true
}

// abandon releases a client whose Start failed and returns err.
func (c *Client) abandon(err error) error {
	c.stdin.Close()
	_ = c.cmd.Process.Kill()
	<-c.exited
	c.stdout.Close()
	return err
}

// tail keeps the last max bytes written to it: the peer's stderr, for
// errors.
type tail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

// suffix is ": its stderr ends: …" for an error message, or "" when the
// peer wrote nothing there.
func (t *tail) suffix() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.b))
	if s == "" {
		return ""
	}
	return "; its stderr ends:\n" + s
}
